"""``memfine train --memory-budget`` checked up front (memfine.flags.budget): the smallest feasible
budget it names is the run-time policy's boundary (MACT: the smallest bin whose exact predicted
peak fits), for the layer and the step scope, and the run-time error names the flags."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from memfine.cli import train as train_cli
from memfine.cli.main import main
from memfine.config import (
    CPU_MAX_BLOCK_ROWS,
    DEFAULT_BACKWARD_BLOCK_BYTES,
    MIN_BLOCK_ROWS,
    MoEConfig,
)
from memfine.memory import layer as layer_memory
from memfine.memory.step import StepPlanner
from memfine.reports.metrics import read_metrics
from memfine.train import preset

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1",
        "--max-steps", "1", "--eval-batches", "1", "--sample-tokens", "0"]
TINY = preset("tiny")
T = TINY.batch_size * TINY.seq_len  # tokens of one MoE layer call: B·Q = 8·64
MOE = TINY.model.moe
# the recompute mode of a budgeted run ("auto" resolves differently with a budget than without)
RECOMPUTE = dataclasses.replace(TINY.model.chunk, memory_budget_bytes=1).resolved_recompute
# rows of the CPU's default row block at the tiny preset's layer in fp32 (at least 512, at
# most the CPU's cap)
DEFAULT_ROWS = min(CPU_MAX_BLOCK_ROWS, max(MIN_BLOCK_ROWS, DEFAULT_BACKWARD_BLOCK_BYTES // (
    (3 * MOE.hidden_size + 3 * MOE.intermediate_size + MOE.up_width) * 4)))


def _smallest_feasible(rows: int, moe: MoEConfig = MOE) -> int:
    """The least exact layer peak over the bins (fp32); rows ≤ T·k never add bytes."""
    assert rows <= T * moe.top_k
    return min(layer_memory.moe_layer_timeline(moe, T, 4, num_chunks=c, recompute=RECOMPUTE).peak
               for c in (1, 2, 4, 8))


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_the_named_budget_is_the_run_time_boundary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropless s″ = T·k: the budget named is met, one byte less is refused before anything is
    written, and at run time (as under torchrun, where nothing is checked up front) the
    policy's refusal names the flags too."""
    need = _smallest_feasible(T * MOE.top_k)
    err = _refused(["--memory-budget", "1KiB", "--out", str(tmp_path / "a")], capsys)
    assert (f"the smallest feasible budget is {need} bytes ({need / 2**20:.2f} MiB)") in err
    assert f"s''={T * MOE.top_k} rows" in err and "--memory-budget 1024 bytes" in err
    assert "--bins 1,2,4,8" in err and "--allow-over-budget" in err
    err = _refused(["--memory-budget", f"{need - 1}B", "--out", str(tmp_path / "a")], capsys)
    assert f"--memory-budget {need - 1} bytes" in err and f"is {need} bytes" in err
    assert list(tmp_path.iterdir()) == []
    assert main(["train", *FAST, "--memory-budget", f"{need}B", "--out", str(tmp_path / "b")]) == 0
    record = read_metrics(tmp_path / "b" / "metrics.jsonl")[0]
    assert record["num_chunks"] == [8, 8] and record["recompute"] == ["experts", "experts"]
    # the first block that fits at c = 8: the default (at this size every block holds all rows)
    assert record["block_rows"] == [DEFAULT_ROWS] * 2  # the device's default, in rows
    monkeypatch.setattr(train_cli, "check_memory_budget", lambda config, world: None)
    err = _refused(["--memory-budget", f"{need - 1}B", "--out", str(tmp_path / "c")], capsys)
    assert f"smallest feasible budget is {need} bytes" in err  # the policy's own message
    assert "--memory-budget" in err and "--bins" in err and "ChunkConfig" not in err


def test_a_capacity_factor_keeps_the_t_k_bound(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """cf = 0.5: s″ ≤ 512 < T·k rows; the exact model of T tokens still bounds the call."""
    rows = MOE.num_experts * math.ceil(0.5 * T * MOE.top_k / MOE.num_experts)
    need = _smallest_feasible(rows, dataclasses.replace(MOE, capacity_factor=0.5))
    flags = ["--capacity-factor", "0.5"]
    err = _refused([*flags, "--memory-budget", f"{need - 1}B", "--out", str(tmp_path)], capsys)
    assert f"is {need} bytes" in err and "s''=512 rows" in err
    assert main(["train", *FAST, *flags, "--memory-budget", f"{need}B", "--out",
                 str(tmp_path)]) == 0


def test_step_scope_names_the_least_memory_plan(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--budget-scope step: the smallest feasible budget is the least-memory step plan's peak;
    at it the run goes, and metrics.jsonl records each layer's c and recompute mode."""
    need = StepPlanner(TINY.model, TINY.batch_size, TINY.seq_len, 4).smallest_feasible_budget()
    flags = ["--budget-scope", "step"]
    err = _refused([*flags, "--memory-budget", f"{need - 1}B", "--out", str(tmp_path)], capsys)
    assert f"--memory-budget {need - 1} bytes" in err and f"is {need} bytes" in err
    assert "the whole step" in err
    assert main(["train", *FAST, *flags, "--memory-budget", f"{need}B", "--out",
                 str(tmp_path)]) == 0
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert len(record["recompute"]) == len(record["num_chunks"]) == TINY.model.num_layers


def test_allow_over_budget_is_not_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The run goes on at the largest bin and warns once, in the flags' words."""
    assert main(["train", *FAST, "--memory-budget", "1KiB", "--allow-over-budget",
                 "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("using the largest bin c=8 (--allow-over-budget)") == 1
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["num_chunks"] == [8, 8]


@pytest.mark.parametrize(("device", "autocast"), [("cpu", "none"), ("cuda", "none"),
                                                  ("cpu", "bfloat16")])
def test_the_check_takes_the_runs_device_and_compute_dtype(device: str, autocast: str) -> None:
    """The up-front check is the layers' own rule: their device's row blocks, and under bf16
    autocast bf16 activations (D_t = 2), so a budget between the devices' least peaks is
    refused for the device that cannot meet it."""
    from memfine.config import ChunkConfig, ModelConfig, MoEConfig, TrainConfig
    from memfine.flags.budget import check_memory_budget
    from memfine.schedule import ChunkPolicy

    moe = MoEConfig(hidden_size=512, intermediate_size=1024, num_experts=8, top_k=2)
    B, Q = 8, 128

    def config(budget: int) -> TrainConfig:
        model = ModelConfig(num_heads=4, moe=moe, chunk=ChunkConfig(memory_budget_bytes=budget))
        return TrainConfig(model=model, batch_size=B, seq_len=Q, device=device,
                           autocast=autocast)  # type: ignore[arg-type]

    dtype_bytes = 2 if autocast == "bfloat16" else 4
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1), moe)
    need = probe.smallest_feasible_budget(B * Q * 2, B * Q, dtype_bytes,
                                          device_type=device)
    assert need != probe.smallest_feasible_budget(B * Q * 2, B * Q, 4,
                                                  device_type="cuda" if device == "cpu"
                                                  else "cpu")
    check_memory_budget(config(need))  # the least peak itself is feasible
    with pytest.raises(ValueError, match="--memory-budget"):
        check_memory_budget(config(need - 1))
