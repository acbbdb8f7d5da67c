"""Metrics lines, expert-load statistics and plots (memfine.reports.metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memfine.reports.metrics import (
    MetricsLog,
    load_max_over_mean,
    nats_to_bits,
    plot_run,
    read_metrics,
)


@pytest.mark.parametrize(("counts", "expected"), [
    pytest.param([4, 4, 4, 4], 1.0, id="balanced"),
    pytest.param([16, 0, 0, 0], 4.0, id="collapsed"),
    pytest.param([3, 1, 0, 0], 3.0, id="skewed"),
    pytest.param([0, 0], 0.0, id="nothing_routed"),
])
def test_load_max_over_mean(counts: list[int], expected: float) -> None:
    assert load_max_over_mean(torch.tensor(counts)) == expected


def test_nats_to_bits() -> None:
    assert nats_to_bits(float(torch.log(torch.tensor(2.0, dtype=torch.float64)))) == 1.0


def test_resumed_log_drops_lines_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2, 3, 4):
        log.write({"step": step})
    with path.open("a") as f:
        f.write('{"step": 5, "trunc')  # a killed run's last line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    MetricsLog(path, keep_until_step=2).write({"step": 3, "again": True})
    assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 3, "again": True}]


def test_plot_run_writes_pngs(tmp_path: Path) -> None:
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step in range(1, 6):
            record = {"step": step, "train_loss": 5.0 - step, "num_chunks": [1, step % 2 + 1]}
            if step % 2 == 0:
                record["val_loss"] = 4.5 - step
            f.write(json.dumps(record) + "\n")
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["chunks.png", "loss.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nonfinite_values_are_null_and_flagged(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "train_loss": float("nan"), "grad_norm": 2.0,
               "per_layer": [1.0, float("inf"), float("-inf")]})
    log.write({"step": 2, "train_loss": 1.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    def bare(constant: str) -> None:
        pytest.fail(f"bare {constant} in metrics.jsonl")

    strict = [json.loads(line, parse_constant=bare) for line in lines]
    assert strict == [{"step": 1, "train_loss": None, "grad_norm": 2.0,
                       "per_layer": [1.0, None, None], "nonfinite": True},
                      {"step": 2, "train_loss": 1.5}]


class _Writer:
    """Records what a tracker is given."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, object, int]] = []
        self.closed = False

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.scalars += [(key, value, step) for key, value in scalars.items()]

    def close(self) -> None:
        self.closed = True


def test_tracker_gets_the_numeric_scalars_of_each_line(tmp_path: Path) -> None:
    writer = _Writer()
    log = MetricsLog(tmp_path / "metrics.jsonl", tracker=writer)
    log.write({"step": 3, "train_loss": 1.25, "lr": 2e-3, "num_chunks": [1, 2],
               "peak_bytes": None, "grad_norm": float("inf"), "other": 7.0})
    log.write({"step": 4, "train_loss": 1.0, "val_loss": 1.5, "tokens_per_s": 100})
    assert writer.scalars[:2] == [("train_loss", 1.25, 3), ("lr", 2e-3, 3)]
    assert writer.scalars[2][:2] == ("grad_norm", float("inf"))  # as measured; jsonl says null
    assert writer.scalars[3:] == [("train_loss", 1.0, 4), ("val_loss", 1.5, 4),
                                  ("tokens_per_s", 100, 4)]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["grad_norm"] is None
    assert not writer.closed
    log.close()
    assert writer.closed


def test_a_one_byte_corpus_reports_a_zero_baseline_without_a_percentage(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memfine.data import encode, unigram_entropy
    from memfine.reports.metrics import report_final

    unigram = unigram_entropy(encode(b"x" * 1000))
    assert f"{unigram:.4f}" == "0.0000"  # not -0.0000
    headline = report_final(tmp_path, step=2, val_loss=4.36, unigram=unigram, tokens_per_s=1.0,
                            wall_s=1.0, sample="", temperature=0.8)
    out = capsys.readouterr().out
    assert "% below" not in out and "% above" not in out
    assert "one byte repeated (unigram entropy 0): the loss is 4.3600 nats/byte above" in out
    assert headline.endswith("above the unigram baseline of 0 (one byte repeated)")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["percent_below_unigram"] is None
    assert summary["unigram_entropy_nats_per_byte"] == 0.0
    assert str(summary["unigram_entropy_nats_per_byte"]) == "0.0"


@pytest.mark.parametrize(("val_loss", "words"), [(1.0, "50.0% below"), (3.0, "50.0% above")])
def test_the_headline_compares_with_the_unigram_baseline(
        tmp_path: Path, val_loss: float, words: str) -> None:
    from memfine.reports.metrics import report_final

    headline = report_final(tmp_path, step=1, val_loss=val_loss, unigram=2.0, tokens_per_s=1.0,
                            wall_s=1.0, sample="", temperature=0.8)
    assert headline == (f"final validation loss {val_loss:.4f} nats/byte = "
                        f"{nats_to_bits(val_loss):.4f} bits/byte, {words} the unigram baseline")
