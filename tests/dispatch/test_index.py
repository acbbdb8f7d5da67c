"""RoutingIndex invariants (docs/style.md §6), the worked example of docs/design.md §3, builders.

The sort-free and argsort builders give identical arrays on any routing; ``auto`` picks by the
dense map size; ``MoEConfig.index_builder`` forces one. Reference: MoEBlaze §3; docs/design.md §3.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable
from pathlib import Path

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
from memfine.memory.layer import moe_layer_timeline
from memfine.nn.experts import GroupedExperts

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
    """The five int32 arrays are identical, and so is E."""
    for name in FIELDS:
        left, right = getattr(a, name), getattr(b, name)
        assert left.dtype == right.dtype == torch.int32, name
        assert torch.equal(left, right), name
    assert a.num_experts == b.num_experts


# docs/design.md §3 (MoEBlaze worked example): E=4, k=2, 5 tokens.
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
    pytest.param(torch.tensor([[1, 0]] * 5), 6, id="empty_expert"),
    pytest.param(torch.tensor([[1], [0], [1], [1]]), 3, id="k1"),
    pytest.param(torch.tensor([[3], [1], [3], [0]]), 5, id="k1_E5"),
    pytest.param(torch.tensor([[2, 0, 1], [0, 1, 2]]), 3, id="k_equals_E"),
    pytest.param(torch.stack([torch.randperm(4) for _ in range(6)]), 4, id="k_equals_E_random"),
    pytest.param(torch.zeros(0, 2, dtype=torch.long), 4, id="empty_batch"),
    pytest.param(torch.tensor([[0, 4], [4, 1], [-1, 4], [2, 7]]), 4, id="sentinels"),
    pytest.param(torch.tensor([[2, 4], [4, 4], [0, 1]]), 4, id="sentinels_one_token_all"),
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
    """(T, k) int64 top_k_index with distinct experts per token and random sentinel slots.

    Tokens choose among the first ``used`` experts only, so experts ``used..E-1`` may stay empty;
    each slot is a sentinel id (outside [0, E)) with probability ``sentinel_p`` (0: none, 1: all).
    """
    E = draw(st.integers(1, 10))
    k = draw(st.integers(1, E))
    used = draw(st.integers(k, E))
    T = draw(st.integers(0, 24))
    sentinel_p = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    rows = []
    for _ in range(T):
        experts = draw(st.permutations(range(used)))[:k]
        rows.append([draw(st.sampled_from([E, E + 2, E + 3, -1]))
                     if draw(st.floats(0, 1)) < sentinel_p else e for e in experts])
    return torch.tensor(rows, dtype=torch.int64).view(T, k), E


@settings(max_examples=300, deadline=None)
@given(routings())
def test_sort_free_equals_argsort(routing: tuple[torch.Tensor, int]) -> None:
    top_k_index, E = routing
    sort_free = build_index_sort_free(top_k_index, E)
    check_invariants(sort_free, top_k_index, E)
    assert_same_index(sort_free, build_index_argsort(top_k_index, E))
    assert_same_index(sort_free, build_routing_index(top_k_index, E, "auto"))
    assert_same_index(sort_free, build_index_sort_free(top_k_index.int(), E))


@pytest.mark.parametrize("top_k_index", [
    pytest.param(torch.tensor([[1, 1]]), id="one_token"),
    pytest.param(torch.tensor([[0, 1], [2, 2]]), id="second_token"),
])
def test_sort_free_rejects_repeated_expert(top_k_index: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="^top_k_index must hold distinct experts within each"):
        build_index_sort_free(top_k_index, 4)


def test_auto_switches_to_argsort_above_the_dense_map_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("_build_sort_free", "build_index_argsort"):
        real = getattr(index_module, name)
        monkeypatch.setattr(index_module, name,
                            lambda idx, E, real=real, name=name: calls.append(name) or real(idx, E))
    monkeypatch.setattr(index_module, "CPU_SORT_FREE_MAX_CELLS", 8)
    distinct = torch.tensor([[1, 3], [0, 2], [2, 0]])
    build_routing_index(distinct, 4)  # T·E = 12 > 8: argsort
    build_routing_index(distinct[:2], 4)  # T·E = 8: sort-free
    assert calls == ["build_index_argsort", "_build_sort_free"]


def test_auto_takes_argsort_when_a_token_repeats_an_expert() -> None:
    """Hash routing (DeepSeek-V4) may give a token one expert twice: each slot gets its row."""
    repeated = torch.tensor([[1, 1], [0, 2], [4, 4]])  # 4 = E: repeated sentinels are fine
    index = build_routing_index(repeated, 4)
    assert_same_index(index, build_index_argsort(repeated, 4))
    assert index.token_index_map[0, 0] != index.token_index_map[0, 1]
    assert torch.equal(index.tokens_per_expert(), torch.tensor([1, 2, 1, 0], dtype=torch.int32))


@pytest.mark.parametrize("builder", BUILDERS)
def test_bad_arguments(builder: Builder) -> None:
    with pytest.raises(ValueError, match=r"^top_k_index must be \(T, k\), got shape \(4,\)$"):
        builder(torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"^top_k_index must be int64 or int32, got torch.float32"):
        builder(torch.zeros(4, 1), 2)
    with pytest.raises(ValueError, match=r"^num_experts must be >= 1, got 0$"):
        builder(torch.zeros(4, 1, dtype=torch.long), 0)


@pytest.mark.parametrize(("top_k_index", "num_experts", "builder"), [
    pytest.param(WORKED_TOP_K, 4, "radix", id="radix"),
    pytest.param(torch.zeros(2, 1, dtype=torch.int64), 2, "bucket", id="bucket"),
])
def test_unknown_builder(top_k_index: torch.Tensor, num_experts: int, builder: str) -> None:
    with pytest.raises(ValueError, match=r"^builder must be 'auto', 'sort_free' or 'argsort', "
                                         rf"got '{builder}'$"):
        build_routing_index(top_k_index, num_experts, builder)  # type: ignore[arg-type]


def test_index_is_frozen() -> None:
    index = build_routing_index(WORKED_TOP_K, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        index.num_experts = 5  # type: ignore[misc]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("_build_sort_free", "build_index_argsort"):
        real = getattr(index_module, name)

        def spy(*args: object, _real=real, _name=name) -> RoutingIndex:  # type: ignore[no-untyped-def]
            calls.append(_name.removeprefix("build_index_").removeprefix("_build_"))
            return _real(*args)

        monkeypatch.setattr(index_module, name, spy)
    return calls


def test_auto_picks_by_dense_map_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    monkeypatch.setattr(index_module, "CPU_SORT_FREE_MAX_CELLS", 40)
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


@pytest.mark.parametrize("num_routed", [0, 3, 8], ids=["none_routed", "some_routed", "all_routed"])
def test_routed_slots_op_is_the_head_of_the_slot_order(num_routed: int) -> None:
    """``memfine::routed_slots`` (the compile path's row slice) returns slot_order[:S] as a new
    tensor, and its fake implementation passes torch.library's checks (unbacked S in [0, T·k])."""
    slot_order_M = torch.randperm(8)
    offsets_E1 = torch.tensor([0, num_routed // 2, num_routed], dtype=torch.int64)
    got = torch.ops.memfine.routed_slots(slot_order_M, offsets_E1)
    assert got.tolist() == slot_order_M.tolist()[:num_routed]
    assert got.data_ptr() != slot_order_M.data_ptr() or num_routed == 0
    assert index_module.routed_slots(slot_order_M, offsets_E1).tolist() == got.tolist()
    torch.library.opcheck(torch.ops.memfine.routed_slots.default, (slot_order_M, offsets_E1))


def test_routed_slots_op_refuses_offsets_past_the_slots() -> None:
    """S above T·k would break the fake implementation's bound: a RuntimeError, not a short
    slice."""
    with pytest.raises(RuntimeError, match=r"S=9 outside \[0, T·k=8\]"):
        torch.ops.memfine.routed_slots(torch.arange(8), torch.tensor([0, 9]))


def _cpu_ratios() -> dict[int, float]:
    """argsort ÷ sort-free median build time per dense-map size, from the committed CSV."""
    path = Path(__file__).parents[2] / "benchmarks" / "results" / "bench_index_cpu.csv"
    with path.open() as f:
        return {int(row["x_value"]): float(row["p50"]) for row in csv.DictReader(f)
                if row["method"] == "argsort" and row["metric"] == "time_ratio_to_sort_free"}


def test_the_cpu_rule_follows_the_measurement() -> None:
    """On the CPU, auto builds sort-free only up to the largest size where argsort lost."""
    ratios = _cpu_ratios()
    limit = index_module.sort_free_max_cells("cpu")
    assert limit == index_module.CPU_SORT_FREE_MAX_CELLS in ratios  # a measured size
    assert all(ratio < 1 for cells, ratio in ratios.items() if cells > limit), ratios
    assert ratios[limit] >= 1, ratios
    assert index_module.sort_free_max_cells("cuda") == index_module.SORT_FREE_MAX_CELLS


def test_auto_on_the_cpu_takes_argsort_above_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    E = 16
    T = index_module.CPU_SORT_FREE_MAX_CELLS // E
    top_k_index = torch.rand(T * 4, E).topk(2, dim=-1).indices
    build_routing_index(top_k_index[:T], E)  # at the limit: sort-free
    build_routing_index(top_k_index[:T + 1], E)  # above it: argsort
    build_routing_index(top_k_index, E)  # 131,072 cells: argsort (0.58-0.77× sort-free's time)
    assert calls == ["sort_free", "argsort", "argsort"]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_memory_model_mirrors_the_rule(device_type: str) -> None:
    """The forward's peak is the index builder's (the router node keeps no (T, E) tensor
    there), so it tells the builders apart; the layer's peak is the router node's backward."""
    moe = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=64, top_k=2)
    T = 2 * index_module.CPU_SORT_FREE_MAX_CELLS // 64  # 65,536 cells

    def forward_peak(config: MoEConfig) -> int:
        return moe_layer_timeline(config, T, 4, device_type=device_type).phase_peaks["forward"]

    by = {b: forward_peak(dataclasses.replace(moe, index_builder=b))
          for b in ("sort_free", "argsort")}
    assert by["sort_free"] != by["argsort"]
    assert forward_peak(moe) == by["argsort" if device_type == "cpu" else "sort_free"]
