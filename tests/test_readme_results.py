"""The README's figures equal the committed results files: the training table (written by `make
results`) and the time ratios of the experts and chunking tables (`memfine bench`)."""

from __future__ import annotations

import csv
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


EXPERTS_ROWS = {  # the README's experts table: row label start → method
    "plain PyTorch": "plain", "`torch._grouped_mm` over": "grouped_mm",
    "torchtitan's own": "torchtitan", "per-expert loop": "expert_loop",
    "full-layer recompute": "full_recompute", "memfine fused + MACT": "fused_mact"}
CHUNKING_COLUMNS = ("fixed_c8", "mact", "no_recompute")  # after full recompute's column


def _ratios(suite: str, reference: str) -> dict[tuple[str, str], str]:
    """(x_value, method) → the CSV's median per-round time ratio to ``reference``, as quoted."""
    with (ROOT / "benchmarks" / "results" / f"bench_{suite}.csv").open() as handle:
        return {(r["x_value"], r["method"]): f"{float(r['p50']):.2f}"
                for r in csv.DictReader(handle)
                if r["metric"] == f"time_ratio_to_{reference}" and r["mode"] == "full"}


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(title)
    return text[start:text.index("\n### ", start + 1)]


def test_readme_experts_time_ratios_equal_the_results_file() -> None:
    ratios = _ratios("experts", "fused")
    section = _section("### One MoE layer: memfine fused vs")
    for label, method in EXPERTS_ROWS.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {label}"))
        quoted = re.findall(r"([\d.]+)×", row.split("|")[3])
        assert quoted == [ratios[(f"conf{c}", method)] for c in (1, 2, 3, 5)], method
    bullet = re.search(r"grouped_mm ÷ fused, median of the 15 per-round ratios, is ([\d., ]+) on",
                       " ".join(section.split()))
    assert bullet is not None
    assert bullet.group(1).split(", ") == [ratios[(f"conf{c}", "grouped_mm")]
                                           for c in (1, 2, 3, 5)]


def test_readme_chunking_time_ratios_equal_the_results_file() -> None:
    ratios = _ratios("chunking", "full_recompute")
    section = _section("### MemFine: chunking under routing skew")
    rows = re.findall(r"^\| (\d) \| (.*) \|$", section, flags=re.M)
    assert [skew for skew, _ in rows] == ["1", "2", "4", "8"]
    for skew, cells in rows:
        quoted = [re.search(r"([\d.]+)×", cell).group(1)  # type: ignore[union-attr]
                  for cell in cells.split(" | ")[1:]]
        assert quoted == [ratios[(skew, m)] for m in CHUNKING_COLUMNS], skew


def test_readme_model_step_ratios_equal_the_results_file() -> None:
    ratios = _ratios("model", "fused")
    text = " ".join(_section("### One MoE layer: memfine fused vs").split())
    quoted = re.search(r"plain ([\d.]+)× the time and \d+ MiB; fused \+ MACT \(c = 2\) ([\d.]+)× "
                       r"and \d+ MiB; full recompute ([\d.]+)×", text)
    assert quoted is not None
    assert list(quoted.groups()) == [ratios[("small", m)]
                                     for m in ("plain", "fused_mact", "full_recompute")]
