"""torchtitan's own training loop (``torchtitan.trainer.Trainer``) with memfine's config function.

Three steps of torchtitan's qwen3 ``debugmodel_moe`` config at test size (tests/integrations/
torchtitan_trainer.py: 2 layers, n = 128, CPU shims, local tokenizer and data), built through
torchtitan's ``ConfigManager`` from ``--module``/``--config`` and torchtitan's
``--override.imports``, in one gloo process: torchtitan's experts, and memfine's config function
with c = 1, c = 2 (override) and a memory budget under which MACT picks c = 4. Losses must match
torchtitan's per step within LOSS_ATOL; the chunk decisions and the first-step memory report
must be those of memfine's memory model at the run's T. 2 to 5 minutes on 2 cores (load): ``slow``.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed "
                    "(pip install -c constraints.txt -e '.[torchtitan]')")

from torchtitan_trainer import (  # noqa: E402
    SMALL_DTYPE_BYTES,
    SMALL_LAYERS,
    SMALL_TOKENS,
    SMALL_TOP_K,
    budget_for_chunks,
    run_in_subprocess,
    small_peak,
    small_policy,
    small_runs,
)

from memfine.config import CPU_MAX_BLOCK_ROWS, DEFAULT_BACKWARD_BLOCK_BYTES  # noqa: E402
from tolerances import LOSS_ATOL  # noqa: E402

# rows of the CPU's default row block at the test-size block (d 256, n 128, SwiGLU, fp32): the
# 2,978 rows of 16 MiB, capped to 1,024
SMALL_DEFAULT_ROWS = min(CPU_MAX_BLOCK_ROWS,
                         DEFAULT_BACKWARD_BLOCK_BYTES // ((3 * 256 + 3 * 128 + 2 * 128) * 4))

pytestmark = pytest.mark.slow

T, K, STEPS = SMALL_TOKENS, SMALL_TOP_K, 3
BUDGET = budget_for_chunks(4)
RUNS = {"torchtitan": None, "c1": None, "c2": '{"num_chunks": 2}',
        "budget": f'{{"memory_budget": {BUDGET}}}'}
CHUNKS = {"c1": 1, "c2": 2, "budget": 4}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("torchtitan_trainer")
    return run_in_subprocess(small_runs(work, RUNS, steps=STEPS), work)


@pytest.mark.parametrize("name", ["c1", "c2", "budget"])
def test_losses_match_torchtitans_experts(results: dict, name: str) -> None:
    want, got = results["torchtitan"]["losses"], results[name]["losses"]
    assert len(want) == len(got) == STEPS
    assert all(math.isfinite(x) for x in want + got)
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert abs(a - b) <= LOSS_ATOL, f"{name} step {step}: {a} vs torchtitan {b}"


def test_torchtitans_run_has_no_memfine_blocks(results: dict) -> None:
    assert results["torchtitan"]["decisions"] == {} == results["torchtitan"]["budgets"]


@pytest.mark.parametrize("name", ["c1", "c2", "budget"])
def test_every_block_reports_its_chunk_decision(results: dict, name: str) -> None:
    c = CHUNKS[name]
    budget = BUDGET if name == "budget" else None
    decisions = results[name]["decisions"]
    assert len(decisions) == SMALL_LAYERS
    chunk = {"memory_budget_bytes": budget} if budget else {"num_chunks": c}
    for block, d in decisions.items():
        assert block.endswith("moe.routed_experts")
        assert d == {"num_chunks": c, "recompute": "none" if c == 1 else "experts",
                     "rows": T * K, "budget_bytes": budget,
                     "predicted_peak_bytes": small_peak(c, **chunk),
                     "block_rows": SMALL_DEFAULT_ROWS}  # the device default (one block here)


def test_first_step_budget_report_is_the_memory_model_at_the_runs_T(results: dict) -> None:
    policy = small_policy(memory_budget_bytes=1)  # what a budget would run
    rows, bins = T * K, (1, 2, 4, 8)
    fixed = policy.predicted_peak(0, 0, SMALL_DTYPE_BYTES, 1)
    peaks = [policy.predicted_peak(rows, T, SMALL_DTYPE_BYTES, c) for c in bins]
    assert 0 < fixed < peaks[0] and peaks[1] < peaks[0]
    least, least_peak = policy.least_memory_plan(rows, T, SMALL_DTYPE_BYTES)
    assert least_peak == policy.smallest_feasible_budget(rows, T, SMALL_DTYPE_BYTES)
    ladder = policy.ladder("cpu", SMALL_DTYPE_BYTES)
    assert ladder == (SMALL_DEFAULT_ROWS, SMALL_DEFAULT_ROWS // 2, SMALL_DEFAULT_ROWS // 4)
    assert least_peak == min(policy.predicted_peak(rows, T, SMALL_DTYPE_BYTES, c, block_rows=b)
                             for c in bins for b in ladder)
    budgets = results["c1"]["budgets"]
    assert len(budgets) == SMALL_LAYERS
    for budget in budgets.values():
        assert budget == {
            "tokens": T, "rows": rows, "dtype_bytes": SMALL_DTYPE_BYTES,
            "fixed_bytes": fixed, "token_bytes": peaks[0] - fixed, "bins": list(bins),
            "bin_peak_bytes": peaks,
            "smallest_feasible_budget_bytes": least_peak,
            "least_memory_bin": least.num_chunks, "least_memory_block_rows": least.block_rows}
