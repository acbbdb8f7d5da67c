"""The README's training figures equal the committed results file (written by `make results`)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_small.json"


def _training_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Training results")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_training_table_equals_the_results_file() -> None:
    summary = json.loads(RESULTS.read_text())["summary"]
    section = _training_section()
    row = re.search(r"\| final validation loss \| ([\d.]+) \| ([\d.]+) \|", section)
    assert row is not None, "the README's training table has no final validation loss row"
    assert row.group(1) == f"{summary['final_val_loss_nats_per_byte']:.4f}"
    assert row.group(2) == f"{summary['final_val_loss_bits_per_byte']:.4f}"
    unigram = re.search(r"\| unigram [^|]*\| ([\d.]+) \| ([\d.]+) \|", section)
    assert unigram is not None
    assert unigram.group(1) == f"{summary['unigram_entropy_nats_per_byte']:.4f}"
    assert unigram.group(2) == f"{summary['unigram_entropy_bits_per_byte']:.4f}"
    below = re.search(r"\*\*([\d.]+)% below\*\*", section)
    assert below is not None and below.group(1) == f"{summary['percent_below_unigram']:.1f}"


def test_results_file_is_consistent() -> None:
    results = json.loads(RESULTS.read_text())
    summary = results["summary"]
    assert summary["step"] == results["config"]["max_steps"]
    nats = summary["final_val_loss_nats_per_byte"]
    assert math.isclose(summary["final_val_loss_bits_per_byte"], nats / math.log(2))
    assert results["val_loss_by_step"][str(summary["step"])] == nats


def test_readme_validation_curve_equals_the_results_file() -> None:
    by_step = json.loads(RESULTS.read_text())["val_loss_by_step"]
    quoted = re.search(r"Validation loss along the run:\s+(.*?)\.\s", _training_section(),
                        flags=re.S)
    assert quoted is not None
    pairs = re.findall(r"([\d.]+) \((?:step )?(\d+)\)", quoted.group(1))
    assert [step for _, step in pairs] == list(by_step)
    for value, step in pairs:
        assert value == f"{by_step[step]:.3f}"
