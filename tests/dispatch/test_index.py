"""RoutingIndex invariants (STYLE.md §6), the DESIGN.md §3 worked example, builder agreement."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfine.dispatch import (
    RoutingIndex,
    build_index_argsort,
    build_index_sort_free,
    build_routing_index,
)

BUILDERS = [pytest.param(build_index_sort_free, id="sort_free"),
            pytest.param(build_index_argsort, id="argsort")]
Builder = Callable[[torch.Tensor, int], RoutingIndex]
FIELDS = ("expert_token_indices", "expert_token_offsets", "token_expert_indices",
          "token_index_map", "expert_slot_indices")


def check_invariants(index: RoutingIndex, top_k_index: torch.Tensor, num_experts: int) -> None:
    """Every RoutingIndex invariant, checked with Python loops against the raw top_k_index."""
    T, k = top_k_index.shape
    E = num_experts
    ids = top_k_index.tolist()
    for name in FIELDS:
        assert getattr(index, name).dtype == torch.int32, name
    assert (index.num_tokens, index.top_k, index.num_experts) == (T, k, E)
    assert torch.equal(index.token_expert_indices, top_k_index.int())
    chosen = {e: [t for t in range(T) for j in range(k) if ids[t][j] == e] for e in range(E)}
    off = index.expert_token_offsets.tolist()
    S = sum(len(v) for v in chosen.values())
    assert len(off) == E + 1 and off[0] == 0 and off[E] == S == index.num_rows
    assert [off[e + 1] - off[e] for e in range(E)] == [len(chosen[e]) for e in range(E)]
    assert index.tokens_per_expert().tolist() == [len(chosen[e]) for e in range(E)]
    rows = index.expert_token_indices.tolist()
    for e in range(E):
        assert rows[off[e]:off[e + 1]] == chosen[e]  # ascending, once per chosen expert
    tmap = index.token_index_map.tolist()
    slots = index.expert_slot_indices.tolist()
    assert len(rows) == len(slots) == S
    for t in range(T):
        for j in range(k):
            e, r = ids[t][j], tmap[t][j]
            if 0 <= e < E:
                assert off[e] <= r < off[e + 1] and rows[r] == t and slots[r] == t * k + j
            else:
                assert r == -1
    assert sorted(r for row in tmap for r in row if r >= 0) == list(range(S))  # a bijection


def assert_same_index(a: RoutingIndex, b: RoutingIndex) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.num_experts == b.num_experts


# DESIGN.md §3 (MoEBlaze worked example): E=4, k=2, 5 tokens.
WORKED_TOP_K = torch.tensor([[2, 3], [0, 1], [0, 3], [1, 2], [0, 3]])


@pytest.mark.parametrize("builder", BUILDERS)
def test_worked_example(builder: Builder) -> None:
    index = builder(WORKED_TOP_K, 4)
    assert index.expert_token_indices.tolist() == [1, 2, 4, 1, 3, 0, 3, 0, 2, 4]
    assert index.expert_token_offsets.tolist() == [0, 3, 5, 7, 10]
    assert index.token_index_map.tolist() == [[5, 7], [0, 3], [1, 8], [4, 6], [2, 9]]
    assert index.token_expert_indices.flatten().tolist() == [2, 3, 0, 1, 0, 3, 1, 2, 0, 3]
    assert index.expert_slot_indices.tolist() == [2, 4, 8, 3, 6, 0, 7, 1, 5, 9]
    check_invariants(index, WORKED_TOP_K, 4)


EDGES = [
    pytest.param(torch.tensor([[0, 2], [2, 0], [3, 0]]), 5, id="empty_experts"),
    pytest.param(torch.tensor([[1], [0], [1], [1]]), 3, id="k1"),
    pytest.param(torch.tensor([[2, 0, 1], [0, 1, 2]]), 3, id="k_equals_E"),
    pytest.param(torch.zeros(0, 2, dtype=torch.long), 4, id="T0"),
    pytest.param(torch.tensor([[0, 4], [4, 1], [-1, 4], [2, 7]]), 4, id="sentinels"),
    pytest.param(torch.full((3, 2), 4), 4, id="all_sentinels"),
    pytest.param(torch.tensor([[3, 1]], dtype=torch.int32), 4, id="int32_T1"),
]


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize(("top_k_index", "num_experts"), EDGES)
def test_edges(builder: Builder, top_k_index: torch.Tensor, num_experts: int) -> None:
    index = builder(top_k_index, num_experts)
    check_invariants(index, top_k_index, num_experts)
    assert_same_index(index, build_index_argsort(top_k_index.long(), num_experts))


@st.composite
def routings(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """Random (T, k) routings, distinct experts per token, some slots set to sentinel ids."""
    E = draw(st.integers(1, 8))
    k = draw(st.integers(1, E))
    T = draw(st.integers(0, 12))
    rows = []
    for _ in range(T):
        row = draw(st.permutations(range(E)))[:k]
        sentinel = draw(st.lists(st.sampled_from([None, None, None, E, E + 2, -1]),
                                 min_size=k, max_size=k))
        rows.append([e if s is None else s for e, s in zip(row, sentinel, strict=True)])
    return torch.tensor(rows, dtype=torch.long).view(T, k), E


@settings(max_examples=150, deadline=None)
@given(routings())
def test_sort_free_equals_argsort(routing: tuple[torch.Tensor, int]) -> None:
    top_k_index, E = routing
    sort_free = build_index_sort_free(top_k_index, E)
    check_invariants(sort_free, top_k_index, E)
    assert_same_index(sort_free, build_index_argsort(top_k_index, E))
    assert_same_index(sort_free, build_routing_index(top_k_index, E, "auto"))


def test_sort_free_rejects_repeated_expert() -> None:
    with pytest.raises(ValueError, match="^top_k_index must hold distinct experts within each"):
        build_index_sort_free(torch.tensor([[0, 1], [2, 2]]), 4)


def test_auto_switches_to_argsort_above_the_dense_map_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import memfine.dispatch.index as index_module

    monkeypatch.setattr(index_module, "SORT_FREE_MAX_CELLS", 8)
    repeated = torch.tensor([[1, 1], [0, 2], [2, 0]])  # only the sort-free builder rejects this
    assert_same_index(build_routing_index(repeated, 4), build_index_argsort(repeated, 4))
    with pytest.raises(ValueError, match="distinct experts"):
        build_routing_index(repeated[:2], 4)  # T·E = 8: sort-free


@pytest.mark.parametrize("builder", BUILDERS)
def test_bad_arguments(builder: Builder) -> None:
    with pytest.raises(ValueError, match=r"^top_k_index must be \(T, k\), got shape \(4,\)$"):
        builder(torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"^top_k_index must be int64 or int32, got torch.float32"):
        builder(torch.zeros(4, 1), 2)
    with pytest.raises(ValueError, match=r"^num_experts must be >= 1, got 0$"):
        builder(torch.zeros(4, 1, dtype=torch.long), 0)


def test_unknown_builder() -> None:
    with pytest.raises(ValueError, match=r"^builder must be 'auto', 'sort_free' or 'argsort', "
                                         r"got 'radix'$"):
        build_routing_index(WORKED_TOP_K, 4, "radix")  # type: ignore[arg-type]


def test_index_is_frozen() -> None:
    index = build_routing_index(WORKED_TOP_K, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        index.num_experts = 5  # type: ignore[misc]
