"""``memfine train --memory-budget`` checked up front (memfine.cli._budget): the smallest feasible
budget it names is the run-time policy's boundary (MemFine Eq. 8-9, MACT bins)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from memfine.artifacts.metrics import read_metrics
from memfine.cli import train as train_cli
from memfine.cli.main import main
from memfine.memory import layer as layer_memory
from memfine.train import preset

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1",
        "--max-steps", "1", "--eval-batches", "1", "--sample-tokens", "0"]
TINY = preset("tiny")
T = TINY.batch_size * TINY.seq_len  # tokens of one MoE layer call: B·Q = 8·64
MOE = TINY.model.moe
# the recompute mode of a budgeted run ("auto" resolves differently with a budget than without)
RECOMPUTE = dataclasses.replace(TINY.model.chunk, memory_budget_bytes=1).resolved_recompute


def _smallest_feasible(rows: int) -> int:
    """fixed + ⌈s″ / c_max⌉ · row from the memory model of one layer call (fp32, c_max = 8)."""
    line = layer_memory.chunk_bytes(T, MOE, 4, recompute=RECOMPUTE)
    return line.fixed_bytes + math.ceil(rows / 8) * line.row_bytes


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
    """Dropless s″ = T·k: the budget named is met at c = 8, one byte less is refused before
    anything is written, and the run-time policy refuses that one at the first step too."""
    need = _smallest_feasible(T * MOE.top_k)
    err = _refused(["--memory-budget", "1KiB", "--out", str(tmp_path / "a")], capsys)
    assert (f"the smallest feasible budget for this model and batch is {need} bytes "
            f"({need / 2**20:.2f} MiB)") in err
    assert f"s''={T * MOE.top_k} rows" in err and "--memory-budget 1024 bytes" in err
    err = _refused(["--memory-budget", f"{need - 1}B", "--out", str(tmp_path / "a")], capsys)
    assert f"--memory-budget {need - 1} bytes" in err and f"is {need} bytes" in err
    assert list(tmp_path.iterdir()) == []
    assert main(["train", *FAST, "--memory-budget", f"{need}B", "--out", str(tmp_path / "b")]) == 0
    assert read_metrics(tmp_path / "b" / "metrics.jsonl")[0]["num_chunks"] == [8, 8]
    monkeypatch.setattr(train_cli, "check_memory_budget", lambda config, world: None)
    err = _refused(["--memory-budget", f"{need - 1}B", "--out", str(tmp_path / "c")], capsys)
    assert f"smallest feasible budget is {need} bytes" in err  # the policy's own message


def test_a_capacity_factor_bounds_the_rows(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """cf = 0.5: each of E = 4 experts keeps ⌈0.5·T·k/E⌉ = 128 pairs, so s″ ≤ 512 < T·k."""
    rows = MOE.num_experts * math.ceil(0.5 * T * MOE.top_k / MOE.num_experts)
    assert rows == 512
    need = _smallest_feasible(rows)
    flags = ["--capacity-factor", "0.5"]
    err = _refused([*flags, "--memory-budget", f"{need - 1}B", "--out", str(tmp_path)], capsys)
    assert f"is {need} bytes" in err and "s''=512 rows" in err
    assert main(["train", *FAST, *flags, "--memory-budget", f"{need}B", "--out",
                 str(tmp_path)]) == 0


@pytest.mark.parametrize(("budget", "remedy"), [
    pytest.param("1KiB", "raise --memory-budget or lower --batch-size or --seq-len",
                 id="below_the_fixed_bytes"),
    pytest.param("700KiB", "raise --memory-budget, add a larger bin to --bins",
                 id="above_the_fixed_bytes"),
])
def test_the_remedy_fits_the_shortfall(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       budget: str, remedy: str) -> None:
    """Below the bytes no chunk count reduces, a larger bin cannot help; above them it can."""
    line = layer_memory.chunk_bytes(T, MOE, 4, recompute=RECOMPUTE)
    assert 1024 < line.fixed_bytes < 700 * 1024 < _smallest_feasible(T * MOE.top_k)
    err = _refused(["--memory-budget", budget, "--out", str(tmp_path)], capsys)
    assert remedy in err and f"{line.fixed_bytes} bytes" in err


def test_allow_over_budget_is_not_refused(tmp_path: Path) -> None:
    """The run goes on at the largest bin and the policy warns."""
    with pytest.warns(UserWarning, match=r"using the largest bin c=8 \(allow_over_budget\)"):
        assert main(["train", *FAST, "--memory-budget", "1KiB", "--allow-over-budget",
                     "--out", str(tmp_path)]) == 0
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["num_chunks"] == [8, 8]
