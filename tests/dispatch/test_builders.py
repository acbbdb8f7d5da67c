"""Sort-free vs argsort index builders: identical arrays on any routing; auto choice; forcing.

Reference: MoEBlaze §3 (sort-free construction); DESIGN.md §3.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memfine.dispatch.index as index_module
from memfine.config import MoEConfig
from memfine.dispatch import (
    RoutingIndex,
    build_index_argsort,
    build_index_sort_free,
    build_routing_index,
)
from memfine.nn.experts import GroupedExperts

_ARRAYS = ("expert_token_indices", "expert_token_offsets", "token_expert_indices",
           "token_index_map", "expert_slot_indices")


def _assert_identical(a: RoutingIndex, b: RoutingIndex) -> None:
    assert a.num_experts == b.num_experts
    for name in _ARRAYS:
        left, right = getattr(a, name), getattr(b, name)
        assert left.dtype == right.dtype == torch.int32, name
        assert torch.equal(left, right), name


def _assert_invariants(index: RoutingIndex, top_k_index: torch.Tensor) -> None:
    """Exact invariants of the four arrays (STYLE.md §6)."""
    E, (T, k) = index.num_experts, top_k_index.shape
    valid_TK = (top_k_index >= 0) & (top_k_index < E)
    off = index.expert_token_offsets.long()
    assert off[0] == 0 and off[-1] == int(valid_TK.sum()) == index.num_rows
    counts = torch.bincount(top_k_index[valid_TK].long(), minlength=E)
    assert torch.equal(off.diff(), counts)
    rows = index.token_index_map.long()
    assert torch.equal(rows >= 0, valid_TK)
    tokens = torch.arange(T)[:, None].expand(T, k)
    # token_index_map inverts the expert-grouped order.
    assert torch.equal(index.expert_token_indices.long()[rows[valid_TK]], tokens[valid_TK])
    slots = torch.arange(T * k).view(T, k)
    assert torch.equal(index.expert_slot_indices.long()[rows[valid_TK]], slots[valid_TK])
    for e in range(E):
        seg = index.expert_token_indices[off[e]:off[e + 1]].long()
        assert torch.all(seg.diff() > 0)  # ascending token ids within an expert
        assert torch.all(top_k_index[seg].eq(e).any(1))


@st.composite
def routings(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """(T, k) int64 top_k_index with distinct experts per token and random sentinel slots.

    Tokens choose among the first ``used`` experts only, so experts ``used..E-1`` stay empty.
    """
    E = draw(st.integers(1, 10))
    k = draw(st.integers(1, E))
    used = draw(st.integers(k, E))
    T = draw(st.integers(0, 24))
    sentinel_p = draw(st.sampled_from([0.0, 0.25, 1.0]))
    rows = []
    for _ in range(T):
        experts = draw(st.permutations(range(used)))[:k]
        fill = draw(st.sampled_from([E, E + 3, -1]))  # sentinel ids lie outside [0, E)
        rows.append([fill if draw(st.floats(0, 1)) < sentinel_p else e for e in experts])
    return torch.tensor(rows, dtype=torch.int64).view(T, k), E


@settings(max_examples=150, deadline=None)
@given(routings())
def test_sort_free_equals_argsort(routing: tuple[torch.Tensor, int]) -> None:
    top_k_index, E = routing
    sort_free = build_index_sort_free(top_k_index, E)
    _assert_identical(sort_free, build_index_argsort(top_k_index, E))
    _assert_invariants(sort_free, top_k_index)
    _assert_identical(sort_free, build_index_sort_free(top_k_index.int(), E))


@pytest.mark.parametrize(("top_k_index", "E"), [
    pytest.param(torch.zeros(0, 2, dtype=torch.int64), 4, id="empty_batch"),
    pytest.param(torch.tensor([[3], [1], [3], [0]]), 5, id="k1"),
    pytest.param(torch.stack([torch.randperm(4) for _ in range(6)]), 4, id="k_equals_E"),
    pytest.param(torch.tensor([[1, 0]] * 5), 6, id="empty_expert"),
    pytest.param(torch.full((3, 2), 4), 4, id="all_sentinel"),
    pytest.param(torch.tensor([[2, 4], [4, 4], [0, 1]]), 4, id="sentinels"),
])
def test_builders_agree_on_edges(top_k_index: torch.Tensor, E: int) -> None:
    sort_free = build_index_sort_free(top_k_index, E)
    _assert_identical(sort_free, build_index_argsort(top_k_index, E))
    _assert_invariants(sort_free, top_k_index)


def test_worked_example() -> None:
    """DESIGN.md §3 worked example (E=4, k=2, 5 tokens), both builders."""
    top_k_index = torch.tensor([[2, 3], [0, 1], [0, 3], [1, 2], [0, 3]])
    for build in (build_index_sort_free, build_index_argsort):
        index = build(top_k_index, 4)
        assert index.expert_token_indices.tolist() == [1, 2, 4, 1, 3, 0, 3, 0, 2, 4]
        assert index.expert_token_offsets.tolist() == [0, 3, 5, 7, 10]
        assert index.token_index_map.tolist() == [[5, 7], [0, 3], [1, 8], [4, 6], [2, 9]]
        assert index.token_expert_indices.view(-1).tolist() == [2, 3, 0, 1, 0, 3, 1, 2, 0, 3]


def test_sort_free_rejects_repeated_expert() -> None:
    with pytest.raises(ValueError, match="distinct experts"):
        build_index_sort_free(torch.tensor([[1, 1]]), 4)


def test_unknown_builder() -> None:
    with pytest.raises(ValueError, match="builder must be"):
        build_routing_index(torch.zeros(2, 1, dtype=torch.int64), 2, "bucket")  # type: ignore[arg-type]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("build_index_sort_free", "build_index_argsort"):
        real = getattr(index_module, name)

        def spy(*args: object, _real=real, _name=name) -> RoutingIndex:  # type: ignore[no-untyped-def]
            calls.append(_name.removeprefix("build_index_"))
            return _real(*args)

        monkeypatch.setattr(index_module, name, spy)
    return calls


def test_auto_picks_by_dense_map_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    monkeypatch.setattr(index_module, "SORT_FREE_MAX_CELLS", 40)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(11)])
    small = build_routing_index(top_k_index[:10], 4)  # T·E = 40 cells: sort-free
    large = build_routing_index(top_k_index, 4)  # 44 cells: argsort
    assert calls == ["sort_free", "argsort"]
    assert small.num_rows == 20 and large.num_rows == 22


@pytest.mark.parametrize("builder", ["sort_free", "argsort"])
def test_config_forces_builder(monkeypatch: pytest.MonkeyPatch, builder: str) -> None:
    calls = _spy(monkeypatch)
    config = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                       index_builder=builder)  # type: ignore[arg-type]
    experts = GroupedExperts(config)
    x_TD = torch.randn(6, 8)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(6)])
    weights_TK = torch.rand(6, 2)
    out = experts(x_TD, top_k_index, weights_TK)
    assert calls == [builder]
    other = "argsort" if builder == "sort_free" else "sort_free"
    forced = GroupedExperts(dataclasses.replace(config, index_builder=other))
    forced.load_state_dict(experts.state_dict())
    assert torch.equal(forced(x_TD, top_k_index, weights_TK), out)  # identical index → bitwise
    assert calls == [builder, other]
