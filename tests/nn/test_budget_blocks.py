"""A memory budget shrinks the fused row blocks before it adds chunks (the block ladder).

With ``backward_block_bytes=None`` a budgeted :class:`ChunkPolicy` tries every bin c with the
device default row block, half and a quarter of it, and the layer runs the first (c, block) whose
predicted peak fits. Small ladders (64, 32 and 16 rows) stand in for the device's MiB sizes so
that the blocks matter at test sizes; expected choices come from the layer timeline
(:func:`memfine.memory.layer.layer_peak_bytes`, equal to ``torch.profiler``), and the layer's
measured peak and results are held against the decision and an unbudgeted run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfine.nn.experts as experts_module
from memfine.config import (
    CPU_MAX_BLOCK_ROWS,
    CUDA_BACKWARD_BLOCK_BYTES,
    DEFAULT_BACKWARD_BLOCK_BYTES,
    MIN_BLOCK_ROWS,
    ChunkConfig,
    ModelConfig,
    MoEConfig,
    TrainConfig,
    backward_block_rows,
    block_row_bytes,
    budget_block_ladder,
    ladder_block_rows,
)
from memfine.measure import measure_backward
from memfine.memory.layer import layer_peak_bytes
from memfine.nn import MoELayer
from memfine.nn.moe import MoEAux
from memfine.reports.memory_log import predicted_moe_layer_peak
from memfine.schedule import ChunkPolicy, InfeasibleBudgetError
from memfine.schedule import policy as policy_module
from spies import record_kwarg
from tolerances import assert_chunked_close

D, N, E, K, T = 32, 64, 8, 2, 96
MOE = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
ROW = (3 * D + 3 * N + 2 * N) * 4  # fp32 bytes of one block row
ROWS = (64, 32, 16)  # S = T·k = 192 rows: 3, 6 and 12 blocks
LADDER = tuple(r * ROW for r in ROWS)  # their byte targets


@pytest.fixture(autouse=True)
def small_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ladder of a config left at None is ROWS; a set block stays the only one."""
    monkeypatch.setattr(policy_module, "ladder_block_rows", lambda moe, dt, device: (
        ROWS if moe.backward_block_bytes is None else ladder_block_rows(moe, dt, device)))


def _peak(c: int, block: int, moe: MoEConfig = MOE) -> int:
    return layer_peak_bytes(dataclasses.replace(moe, backward_block_bytes=block), T, 4,
                            num_chunks=c, recompute="experts")


def test_the_ladder_halves_the_default_blocks_rows_twice() -> None:
    mib = 2**20
    assert 16 * mib == DEFAULT_BACKWARD_BLOCK_BYTES
    narrow = block_row_bytes(512, 128, 256, 4)  # 16 MiB holds 1,927 rows, capped to 1,024
    assert DEFAULT_BACKWARD_BLOCK_BYTES // narrow == 1927
    rows = CPU_MAX_BLOCK_ROWS
    assert rows == 1024
    assert budget_block_ladder(None, "cpu", narrow)[0] is None  # the default, as its own value
    assert [backward_block_rows(b, 512, 128, 256, 4)
            for b in budget_block_ladder(None, "cpu", narrow)] == [rows, rows // 2, rows // 4]
    # the cap is the CPU's: a CUDA device's default at these rows holds all 16 MiB's
    assert backward_block_rows(None, 512, 128, 256, 4, "cuda") == (
        CUDA_BACKWARD_BLOCK_BYTES // narrow)
    # a coarse layer (d 512, n 1024 fp32: 630 rows in 16 MiB) is below the cap: unchanged
    coarse = block_row_bytes(512, 1024, 2048, 4)
    assert backward_block_rows(None, 512, 1024, 2048, 4) == (
        DEFAULT_BACKWARD_BLOCK_BYTES // coarse) == 630
    assert budget_block_ladder(4096, "cpu", narrow) == (4096,)
    # d 1024, n 4096 fp32: 16 MiB holds 178 rows, raised to MIN_BLOCK_ROWS for the default,
    # so the ladder halves those 512 rows, and its targets run the rows they name
    wide = block_row_bytes(1024, 4096, 8192, 4)
    assert DEFAULT_BACKWARD_BLOCK_BYTES // wide == 178
    ladder = budget_block_ladder(None, "cpu", wide)
    assert ladder == (None, 256 * wide, 128 * wide)
    assert [backward_block_rows(b, 1024, 4096, 8192, 4) for b in ladder] == [
        MIN_BLOCK_ROWS, 256, 128]
    # rows of exactly 64 KiB and 128 KiB: a rung of 256 or 128 rows is 16 MiB, the CPU
    # default's byte target, and runs the rows it names (the default is None, not its bytes)
    for d in (2048, 4096):
        ladder = budget_block_ladder(None, "cpu", block_row_bytes(d, d, 2 * d, 4))
        assert DEFAULT_BACKWARD_BLOCK_BYTES in ladder[1:]
        assert [backward_block_rows(b, d, d, 2 * d, 4) for b in ladder] == [512, 256, 128]
    qwen3 = block_row_bytes(2048, 768, 1536, 2)
    cuda_rows = CUDA_BACKWARD_BLOCK_BYTES // qwen3
    assert [backward_block_rows(b, 2048, 768, 1536, 2, "cuda")
            for b in budget_block_ladder(None, "cuda", qwen3)] == [
        cuda_rows, cuda_rows // 2, cuda_rows // 4]


def _run(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out, _ = layer(x)
    out.backward(grad)
    assert x.grad is not None and layer.experts.w_up.grad is not None
    assert layer.experts.w_down.grad is not None
    return out.detach(), x.grad, layer.experts.w_up.grad, layer.experts.w_down.grad


def test_a_budget_between_block_sizes_runs_unchunked_with_smaller_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    peaks = {b: _peak(1, b) for b in LADDER}
    budget = peaks[LADDER[-1]]
    assert peaks[LADDER[0]] > budget  # the default block needs chunks at this budget
    want = next(r for r, b in zip(ROWS, LADDER, strict=True) if peaks[b] <= budget)
    blocks = record_kwarg(monkeypatch, experts_module, "run_experts", "block_rows")
    torch.manual_seed(0)
    layer = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=budget))
    ref = MoELayer(MOE, chunk=ChunkConfig(num_chunks=1, recompute="none"))
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(T, D)
    grad = torch.randn(T, D)
    got = _run(layer, x.clone().requires_grad_(), grad)
    decision = layer.last_decision
    assert decision is not None
    assert (decision.num_chunks, decision.block_rows) == (1, want)
    assert decision.predicted_peak_bytes == peaks[want * ROW] <= budget
    assert set(blocks) == {want}  # every (re)computation ran the chosen block
    blocks.clear()
    expected = _run(ref, x.clone().requires_grad_(), grad)
    assert set(blocks) == {ROWS[0]}  # the (stand-in) default, resolved by the policy
    names = ("out", "x.grad", "w_up.grad", "w_down.grad")
    for name, a, b in zip(names, got, expected, strict=True):  # blocks split the row sums
        assert_chunked_close(a, b, name)


def test_the_profiled_peak_of_the_chosen_blocks_is_the_prediction() -> None:
    budget = _peak(1, LADDER[1])
    torch.manual_seed(1)
    layer = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=budget))
    x = torch.randn(T, D, requires_grad=True)
    grads = [torch.randn(T, D), torch.tensor(0.01), torch.tensor(0.001)]
    kept: list[object] = []

    def forward() -> list[torch.Tensor]:
        out, aux = layer(x)
        kept[:] = [aux]
        return [out, aux.load_balancing_loss, aux.z_loss]

    measured = measure_backward(forward, grads, exclude=layer.parameters(), peak="profiler")
    decision = layer.last_decision
    assert decision is not None and decision.block_rows == ROWS[1]
    assert measured.peak_bytes == decision.predicted_peak_bytes
    aux = kept[0]
    assert isinstance(aux, MoEAux) and aux.block_rows == ROWS[1]  # what the train log reads
    config = TrainConfig(model=ModelConfig(vocab_size=16, num_layers=1,
                                           num_heads=2, moe=MOE,
                                           chunk=ChunkConfig(memory_budget_bytes=budget)),
                         dtype="float32")
    assert predicted_moe_layer_peak(config, T, 1, "experts", block_rows=ROWS[1]) == (
        measured.peak_bytes)


def test_shared_experts_run_the_routed_experts_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = dataclasses.replace(MOE, num_shared_experts=1)
    budget = _peak(1, LADDER[-1], moe)
    assert _peak(1, LADDER[0], moe) > budget
    blocks = record_kwarg(monkeypatch, experts_module, "run_experts", "block_rows")
    layer = MoELayer(moe, chunk=ChunkConfig(memory_budget_bytes=budget))
    out, _ = layer(torch.randn(T, D))
    decision = layer.last_decision
    assert decision is not None and decision.num_chunks == 1
    assert decision.block_rows != ROWS[0]
    assert blocks == [decision.block_rows] * 2  # routed, then shared (n_s = n: the same rows)


def test_a_set_block_is_never_shrunk() -> None:
    fixed = dataclasses.replace(MOE, backward_block_bytes=LADDER[0])
    budget = _peak(1, LADDER[-1])
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=budget), fixed)
    assert policy.candidates() == tuple((c, ROWS[0]) for c in (1, 2, 4, 8))
    decision = policy.decide(T * K, T, 4)
    assert decision.num_chunks > 1 and decision.block_rows == ROWS[0]
    want = next(c for c in (1, 2, 4, 8) if _peak(c, LADDER[0]) <= budget)
    assert decision.num_chunks == want


def test_a_smaller_chunk_count_wins_over_a_larger_block() -> None:
    """Candidates are c first: c = 1 at the smallest block before c = 2 at the default."""
    budget = _peak(1, LADDER[-1])
    assert _peak(2, LADDER[0]) <= budget or _peak(4, LADDER[0]) <= budget
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=budget), MOE)
    assert policy.candidates()[:4] == ((1, ROWS[0]), (1, ROWS[1]), (1, ROWS[2]), (2, ROWS[0]))
    assert policy.decide(T * K, T, 4).num_chunks == 1


def test_an_agreed_larger_c_takes_the_largest_block_that_fits_there() -> None:
    budget = _peak(1, LADDER[-1])
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=budget), MOE)
    seen: list[int] = []
    decision = policy.decide(T * K, T, 4, agree=lambda c: seen.append(c) or 4)  # type: ignore[func-returns-value]
    assert seen == [1] and decision.num_chunks == 4
    want = next(r for r in ROWS if _peak(4, r * ROW) <= budget)
    assert decision.block_rows == want
    assert decision.predicted_peak_bytes == _peak(4, want * ROW)


def test_infeasible_budget_names_the_least_peak_over_every_block() -> None:
    need = min(_peak(c, b) for c in (1, 2, 4, 8) for b in LADDER)
    best = min(((c, r) for c in (1, 2, 4, 8) for r in ROWS),
               key=lambda cr: (_peak(cr[0], cr[1] * ROW), cr))
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=need - 1), MOE)
    assert policy.smallest_feasible_budget(T * K, T, 4) == need
    with pytest.raises(InfeasibleBudgetError) as info:
        policy.decide(T * K, T, 4)
    assert info.value.smallest_feasible_bytes == need
    assert f"at best (c={best[0]}, row blocks of {best[1]} rows)" in str(info.value)
    with pytest.warns(UserWarning, match="using the largest bin c=8"):
        over = ChunkPolicy(ChunkConfig(memory_budget_bytes=need - 1, allow_over_budget=True),
                           MOE).decide(T * K, T, 4)
    at8 = {r: _peak(8, r * ROW) for r in ROWS}
    assert (over.num_chunks, over.block_rows) == (8, min(ROWS, key=lambda r: (at8[r], r)))


def test_a_lora_layer_runs_the_budgets_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from memfine.config.lora import LoRAConfig
    from memfine.nn import lora as lora_module

    lora = LoRAConfig(rank=4, alpha=8.0)
    probe = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=1), lora=lora).policy
    peaks = [probe.layer_peak(T, 4, 1, block_rows=r) for r in ROWS]
    assert peaks[0] > peaks[-1]
    blocks = record_kwarg(monkeypatch, lora_module, "run_lora_experts", "block_rows")
    layer = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=peaks[-1]), lora=lora)
    out, _ = layer(torch.randn(T, D))
    out.sum().backward()
    decision = layer.last_decision
    want = next(r for r, p in zip(ROWS, peaks, strict=True) if p <= peaks[-1])
    assert decision is not None and (decision.num_chunks, decision.block_rows) == (1, want)
    assert set(blocks) == {want} and want != ROWS[0]


def test_the_bench_prediction_follows_the_budgets_blocks() -> None:
    """The suites' memory prediction of a budgeted layer takes the row blocks its call ran."""
    from memfine.baselines.layers import layer_method
    from memfine.bench.harness import run_methods

    budget = _peak(1, LADDER[1])
    torch.manual_seed(2)
    layer = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=budget))
    x = torch.randn(T, D, requires_grad=True)
    method = layer_method("mact", layer, x, torch.randn(T, D), budget_bytes=budget,
                          peak="profiler")
    (res,) = run_methods([method], repeats=1, warmup=0)
    assert res.error is None and res.memory is not None
    assert res.extras["block_rows"] == (ROWS[1], "rows")
    assert res.predicted["peak_bytes"] == res.memory.peak_bytes == _peak(1, LADDER[1])


def test_under_autocast_the_policy_counts_the_compute_dtype() -> None:
    """fp32 activations under bf16 autocast: the experts compute (and keep H) in bf16, so the
    policy predicts with D_t = 2, not x's 4 (the weights' bf16 copies are not modelled)."""
    layer = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=2**40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(T, D))
    decision = layer.last_decision
    assert decision is not None and decision.num_chunks == 1
    want = layer.policy.predicted_peak(T * K, T, 2, 1, block_rows=decision.block_rows)
    assert decision.predicted_peak_bytes == want != layer.policy.predicted_peak(
        T * K, T, 4, 1, block_rows=decision.block_rows)
