"""ChunkPolicy: fixed c, MACT's exact choice (the smallest bin whose timeline peak fits), errors,
agreement, the recorded ChunkDecision.

Expected values come from the layer timeline itself (:func:`memfine.memory.layer.
layer_peak_bytes`, held equal to torch.profiler by tests/memory and tests/measure), and for the
single-layer figures of the budget tests from an independent reading of the timeline
(:func:`memfine.memory.layer.moe_layer_timeline`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from memfine.config import (
    CUDA_BACKWARD_BLOCK_BYTES,
    DEFAULT_BACKWARD_BLOCK_BYTES,
    ChunkConfig,
    MoEConfig,
)
from memfine.memory import layer as layer_memory
from memfine.schedule import ChunkDecision, ChunkPolicy, InfeasibleBudgetError
from memfine.schedule import policy as policy_module
from memfine.units import format_bytes

MIB = 2**20
# One row-block size: the tests of the bins below see c alone (the block ladder of a config left
# at backward_block_bytes=None has its own tests at the end).
BLOCK = 16 * MIB
MOE = MoEConfig(hidden_size=64, intermediate_size=128, num_experts=8, top_k=2,
                backward_block_bytes=BLOCK)
BLOCK_ROWS = BLOCK // ((3 * 64 + 3 * 128 + 256) * 4)  # the policy's rows per block in fp32
T, DT = 2048, 4


def _peak(c: int, recompute: str = "experts", moe: MoEConfig = MOE, tokens: int = T) -> int:
    return layer_memory.moe_layer_timeline(moe, tokens, DT, num_chunks=c,
                                           recompute=recompute).peak


def _budgeted(budget: int, **kwargs: object) -> ChunkPolicy:
    return ChunkPolicy(ChunkConfig(memory_budget_bytes=budget, **kwargs), MOE)  # type: ignore[arg-type]


def test_fixed_num_chunks_ignores_the_rows_and_records_the_prediction() -> None:
    policy = ChunkPolicy(ChunkConfig(num_chunks=3), MOE)
    assert not policy.budgeted
    assert [policy.num_chunks(r, T, DT) for r in (0, 10, 10**9)] == [3, 3, 3]
    assert policy.last_decision == ChunkDecision(3, "experts", T * MOE.top_k, _peak(3), None,
                                                 BLOCK_ROWS)


@pytest.mark.parametrize("recompute", ["none", "experts", "full"])
@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_budget_at_a_bins_peak_picks_the_smallest_bin_that_fits(recompute: str, c: int) -> None:
    """A budget equal to bin c's exact peak gets the smallest bin whose peak is ≤ it."""
    peaks = {b: _peak(b, recompute) for b in (1, 2, 4, 8)}
    want = min(b for b in peaks if peaks[b] <= peaks[c])
    policy = _budgeted(peaks[c], recompute=recompute)
    decision = policy.decide(T * MOE.top_k, T, DT)
    assert decision == ChunkDecision(want, recompute, T * MOE.top_k, peaks[want], peaks[c],
                                     BLOCK_ROWS)
    assert policy.last_decision == decision
    if want > 1:  # one byte less than the chosen bin's peak needs a larger bin (or fails)
        smaller = [b for b in peaks if b < want]
        assert all(peaks[b] > peaks[c] for b in smaller)


def test_single_layer_targets() -> None:
    """d 512, n 1024, E 16, k 4, fp32: c = 4 at 400 MiB (T 16384); 145 MiB accepted at T 4096.

    Since the fused forward streams over row blocks, c = 2 peaks at 429.5 MiB at T 16384, so a
    450 MiB budget takes c = 2 (fewer chunks), and 400 MiB is the budget between c = 2 and 4.
    """
    moe = MoEConfig(hidden_size=512, intermediate_size=1024, num_experts=16, top_k=4)
    assert ChunkPolicy(ChunkConfig(memory_budget_bytes=450 * MIB), moe).num_chunks(
        16384 * 4, 16384, DT) == 2
    big = ChunkPolicy(ChunkConfig(memory_budget_bytes=400 * MIB), moe)
    assert big.num_chunks(16384 * 4, 16384, DT) == 4
    assert _peak(2, moe=moe, tokens=16384) > 400 * MIB >= _peak(4, moe=moe, tokens=16384)
    small = ChunkPolicy(ChunkConfig(memory_budget_bytes=145 * MIB), moe)
    assert small.num_chunks(4096 * 4, 4096, DT) == 8
    assert small.last_decision is not None
    assert small.last_decision.predicted_peak_bytes == _peak(8, moe=moe, tokens=4096) <= 145 * MIB


def test_fewer_received_rows_never_need_more_chunks() -> None:
    """On one process s″ ≤ T·k: the prediction is the T·k timeline (an upper bound)."""
    policy = _budgeted(_peak(4))
    assert {policy.num_chunks(r, T, DT) for r in (0, 1, T, T * MOE.top_k)} == {4}


def test_rows_beyond_t_k_and_transport_rows_raise_the_prediction() -> None:
    """Under EP a rank may receive more than T·k rows and keeps d elements per row more."""
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=10**12), MOE)
    row = layer_memory.expert_row_bytes(MOE, DT, recompute="experts")
    S = T * MOE.top_k
    assert policy.predicted_peak(S, T, DT, 2) == _peak(2)
    assert policy.predicted_peak(S + 8, T, DT, 2) == _peak(2) + 4 * row
    assert policy.predicted_peak(S, T, DT, 2, transport_row_elements=64) == (
        _peak(2) + (S // 2) * 64 * DT)


def test_infeasible_budget_is_one_line_naming_fields_and_smallest_feasible_budget() -> None:
    need = _peak(8)
    policy = _budgeted(need - 1)
    assert policy.smallest_feasible_budget(T * 2, T, DT) == need
    with pytest.raises(InfeasibleBudgetError) as info:
        policy.num_chunks(T * 2, T, DT)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"ChunkConfig.memory_budget_bytes {format_bytes(need - 1, exact=True)} "
                          "cannot be met by any chunk count in ChunkConfig.bins 1,2,4,8")
    assert f"the smallest feasible budget is {format_bytes(need, exact=True)}" in msg
    assert "ChunkConfig.allow_over_budget" in msg
    assert isinstance(info.value, ValueError)
    assert info.value.smallest_feasible_bytes == need
    assert "--memory-budget" in info.value.message({"budget": "--memory-budget",
                                                    "bins": "--bins",
                                                    "allow": "--allow-over-budget"})
    assert _budgeted(need).num_chunks(T * 2, T, DT) == 8  # the named budget is feasible


def test_allow_over_budget_uses_largest_bin_and_warns_once() -> None:
    policy = _budgeted(_peak(8) - 1, allow_over_budget=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy.num_chunks(T * 2, T, DT) == 8
        assert policy.num_chunks(T * 2, T, DT) == 8
        assert policy.num_chunks(16 * 2, 16, DT) == 1  # a small call fits at c = 1
    assert len(caught) == 1
    assert "using the largest bin c=8" in str(caught[0].message)


def test_agreement_gets_the_local_choice_and_its_result_is_used() -> None:
    seen: list[int] = []
    policy = _budgeted(_peak(2))
    c = policy.num_chunks(T * 2, T, DT, agree=lambda c: seen.append(c) or 4)  # type: ignore[func-returns-value]
    assert (seen, c) == ([2], 4)
    assert policy.last_decision is not None
    assert policy.last_decision.predicted_peak_bytes == _peak(4)
    # an infeasible rank sends a value above the largest bin, so every rank fails together
    seen.clear()
    with pytest.raises(InfeasibleBudgetError):
        _budgeted(1).num_chunks(T * 2, T, DT, agree=lambda c: seen.append(c) or c)  # type: ignore[func-returns-value]
    assert seen == [9]
    with pytest.raises(InfeasibleBudgetError, match="another rank"):
        _budgeted(_peak(2)).num_chunks(T * 2, T, DT, agree=lambda c: 9)


def test_peaks_are_replayed_once_per_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = layer_memory.layer_peak_bytes

    def counting(*args: object, **kwargs: object) -> int:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_memory, "layer_peak_bytes", counting)
    policy = _budgeted(_peak(8))
    for _ in range(5):
        policy.num_chunks(T * 2, T, DT)
    assert len(calls) == 4  # one replay per bin, then cached


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="recv_rows and num_tokens must be >= 0"):
        _budgeted(10**9).num_chunks(-1, T, DT)


@pytest.mark.parametrize("recompute", ["none", "experts"])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_token_thresholds_choose_as_the_decision_for_every_token_count(
        recompute: str, dtype_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled rule (first (c, block) candidate with T ≤ T_max) is ``decide``'s choice at
    every T with s″ = T·k (dropless) and with fewer rows (capacity drops), and T_max is the
    largest T whose peak fits (T_max + 1 does not). A ladder of 16, 8 and 4 rows per block
    makes the row blocks matter at these sizes."""
    row = (3 * 16 + 3 * 32 + 64) * dtype_bytes
    moe = MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2)
    budget = 45_000 if dtype_bytes == 4 else 40_000
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=budget, recompute=recompute), moe)
    assert row  # one block row's bytes: the ladder's rows run (16, 8, 4)·row of transients
    ladder = (16, 8, 4)
    monkeypatch.setattr(policy_module, "ladder_block_rows", lambda moe, dt, device: ladder)
    assert policy.candidates() == tuple((c, b) for c in (1, 2, 4, 8) for b in ladder)
    limits = policy.token_limits(dtype_bytes)
    for (c, block), limit in zip(policy.candidates(), limits, strict=True):
        assert limit >= 0
        assert policy.layer_peak(limit, dtype_bytes, c, block_rows=block) <= budget
        assert policy.layer_peak(limit + 1, dtype_bytes, c, block_rows=block) > budget
    chosen = set()
    for tokens in range(max(limits) + 1):
        rule = next(cand for cand, limit in zip(policy.candidates(), limits, strict=True)
                    if tokens <= limit)
        chosen.add(rule)
        for rows in {tokens * moe.top_k, tokens}:
            decision = policy.decide(rows, tokens, dtype_bytes)
            assert (decision.num_chunks, decision.block_rows) == rule, (tokens, rows)
    assert len({c for c, _ in chosen}) >= (3 if recompute == "experts" else 1), chosen
    assert len({b for _, b in chosen}) >= 2, chosen
    with pytest.raises(InfeasibleBudgetError):
        policy.decide((max(limits) + 1) * moe.top_k, max(limits) + 1, dtype_bytes)


def test_token_thresholds_are_cached_and_need_a_budget(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    policy = _budgeted(10 * MIB)
    limits = policy.token_limits(DT)
    monkeypatch.setattr(layer_memory, "layer_peak_bytes", None)  # a second search would fail
    assert policy.token_limits(DT) == limits
    assert ChunkPolicy.registered(policy.key) is policy
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        ChunkPolicy(ChunkConfig(num_chunks=2), MOE).token_limits(DT)


def test_the_device_default_block_is_resolved_by_the_device_given() -> None:
    """None is the device default everywhere; the memory model resolves it for the device."""
    moe = MoEConfig(hidden_size=64, intermediate_size=128, num_experts=8, top_k=2)
    cuda = replace(moe, backward_block_bytes=CUDA_BACKWARD_BLOCK_BYTES)  # all rows, one block
    for device_type, same in (("cpu", moe), ("cuda", cuda)):
        assert layer_memory.layer_peak_bytes(moe, 8192, 2, device_type=device_type) == \
            layer_memory.layer_peak_bytes(same, 8192, 2, device_type=device_type)
    assert layer_memory.layer_peak_bytes(moe, 8192, 2) != layer_memory.layer_peak_bytes(
        cuda, 8192, 2)


def test_predictions_follow_the_row_blocks_of_the_activations_device() -> None:
    # coarse layer, T 8192 fp32: S·row bytes is ~1 GiB, 16 MiB blocks on the CPU and 512 MiB
    # on CUDA, whose block transients the CUDA prediction must count
    moe = MoEConfig(hidden_size=512, intermediate_size=1024, num_experts=16, top_k=4)
    tokens, dt = 8192, 4

    def peak(config: MoEConfig, c: int, device_type: str = "cpu") -> int:
        return layer_memory.layer_peak_bytes(config, tokens, dt, num_chunks=c,
                                             recompute="experts", device_type=device_type)

    cpu, cuda = peak(moe, 1), peak(moe, 1, "cuda")
    assert cuda > cpu + 200 * 2**20
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=cpu, recompute="experts"), moe)
    assert policy.layer_peak(tokens, dt, 1) == cpu
    assert policy.layer_peak(tokens, dt, 1, device_type="cuda") == cuda
    # the budget that holds c = 1 on the CPU is above every CUDA block size at c = 1 and needs
    # c = 2 there, with the largest block of the ladder that fits (512 MiB, then half and a
    # quarter of its rows)
    row = (3 * 512 + 3 * 1024 + 2048) * dt
    rows = CUDA_BACKWARD_BLOCK_BYTES // row
    blocks = (None, rows // 2 * row, rows // 4 * row)
    assert policy.ladder("cuda", dt) == (rows, rows // 2, rows // 4)
    cuda_peaks = {(c, b): peak(replace(moe, backward_block_bytes=b), c, "cuda")
                  for c in (1, 2) for b in blocks}
    assert min(cuda_peaks[1, b] for b in blocks) > cpu
    want = next(b for b in blocks if cuda_peaks[2, b] <= cpu)
    assert policy.num_chunks(tokens * 4, tokens, dt) == 1
    cpu_rows = DEFAULT_BACKWARD_BLOCK_BYTES // row  # the CPU's default
    assert policy.decide(tokens * 4, tokens, dt).block_rows == cpu_rows
    decision = policy.decide(tokens * 4, tokens, dt, device_type="cuda")
    assert (decision.num_chunks, decision.block_rows) == (2, rows if want is None else want // row)
    assert decision.predicted_peak_bytes == cuda_peaks[2, want]
    assert max(policy.token_limits(dt, "cuda")[:3]) < tokens <= policy.token_limits(dt)[0]


def test_layers_ask_the_policy_for_their_inputs_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from memfine.nn import MoELayer

    seen: list[str] = []
    real = ChunkPolicy.plan

    def spying(self: ChunkPolicy, *args: object, **kwargs: object) -> object:
        seen.append(str(kwargs.get("device_type")))
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ChunkPolicy, "plan", spying)
    moe = MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2)
    for chunk in (ChunkConfig(num_chunks=2), ChunkConfig(memory_budget_bytes=2**30)):
        MoELayer(moe, chunk=chunk)(torch.randn(8, 16))
    assert seen == ["cpu", "cpu"]
