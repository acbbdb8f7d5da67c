"""The docs' figures equal the committed results files: docs/results.md's training table (written
by `make results`) and the time ratios of its experts, model-step and chunking tables
(`memfine bench`), and the transformers, torchtitan and compile tables of docs/hf.md,
docs/torchtitan.md and docs/compile.md (`benchmarks/`)."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_small.json"
RESULTS_DOC = ROOT / "docs" / "results.md"


def _section(title: str) -> str:
    """docs/results.md's section whose heading starts with ``title``, to the next heading."""
    text = RESULTS_DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _training_section() -> str:
    return _section("Training")


def test_training_table_equals_the_results_file() -> None:
    summary = json.loads(RESULTS.read_text())["summary"]
    section = _training_section()
    row = re.search(r"\| final validation loss \| ([\d.]+) \| ([\d.]+) \|", section)
    assert row is not None, "docs/results.md's training table has no final validation loss row"
    assert row.group(1) == f"{summary['final_val_loss_nats_per_byte']:.4f}"
    assert row.group(2) == f"{summary['final_val_loss_bits_per_byte']:.4f}"
    unigram = re.search(r"\| unigram [^|]*\| ([\d.]+) \| ([\d.]+) \|", section)
    assert unigram is not None
    assert unigram.group(1) == f"{summary['unigram_entropy_nats_per_byte']:.4f}"
    assert unigram.group(2) == f"{summary['unigram_entropy_bits_per_byte']:.4f}"
    below = re.search(r"\*\*([\d.]+)% below\*\*", section)
    assert below is not None and below.group(1) == f"{summary['percent_below_unigram']:.1f}"


def test_readme_run_time_and_load_equal_the_results_file() -> None:
    results = json.loads(RESULTS.read_text())
    summary, environment = results["summary"], results["environment"]
    text = " ".join(_training_section().split())
    quoted = re.search(r"load average ([\d.]+) at the end\) and took (\d+) s inside the "
                       r"training run \(([\d,]+) tokens/s\)", text)
    assert quoted is not None
    assert list(quoted.groups()) == [f"{environment['load_average_1min']:.1f}",
                                     f"{summary['wall_s']:.0f}", f"{summary['tokens_per_s']:,.0f}"]
    assert f"{environment['utc_timestamp'][:10]}:" in text


def test_results_file_is_consistent() -> None:
    results = json.loads(RESULTS.read_text())
    summary = results["summary"]
    assert summary["step"] == results["config"]["max_steps"]
    nats = summary["final_val_loss_nats_per_byte"]
    assert math.isclose(summary["final_val_loss_bits_per_byte"], nats / math.log(2))
    assert results["val_loss_by_step"][str(summary["step"])] == nats


def test_validation_curve_equals_the_results_file() -> None:
    by_step = json.loads(RESULTS.read_text())["val_loss_by_step"]
    quoted = re.search(r"Validation loss along the run:\s+(.*?)\.\s", _training_section(),
                        flags=re.S)
    assert quoted is not None
    pairs = re.findall(r"([\d.]+) \((?:step )?(\d+)\)", quoted.group(1))
    assert [step for _, step in pairs] == list(by_step)
    for value, step in pairs:
        assert value == f"{by_step[step]:.3f}"


EXPERTS_ROWS = {  # docs/results.md's experts table: row label start → method
    "plain PyTorch": "plain", "`torch._grouped_mm` over": "grouped_mm",
    "torchtitan's own": "torchtitan", "per-expert loop": "expert_loop",
    "full-layer recompute": "full_recompute", "memfine fused + MACT": "fused_mact"}
CHUNKING_COLUMNS = ("fixed_c8", "mact", "no_recompute")  # after full recompute's column


def _rows(name: str) -> list[dict[str, str]]:
    with (ROOT / "benchmarks" / "results" / name).open() as handle:
        return list(csv.DictReader(handle))


def _values(name: str, metric: str, mode: str = "full") -> dict[tuple[str, str], dict[str, str]]:
    """(x_value, method) → the row of ``metric`` (and ``mode``) in results file ``name``."""
    return {(r["x_value"], r["method"]): r for r in _rows(name)
            if r["metric"] == metric and r["mode"] == mode}


def _ratios(suite: str, reference: str) -> dict[tuple[str, str], str]:
    """(x_value, method) → the CSV's median per-round time ratio to ``reference``, as quoted."""
    return {key: f"{float(r['p50']):.2f}"
            for key, r in _values(f"bench_{suite}.csv", f"time_ratio_to_{reference}").items()}


def test_experts_time_ratios_equal_the_results_file() -> None:
    ratios = _ratios("experts", "fused")
    section = _section("One MoE layer: memfine fused vs")
    for label, method in EXPERTS_ROWS.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {label}"))
        quoted = re.findall(r"([\d.]+)×", row.split("|")[3])
        assert quoted == [ratios[(f"conf{c}", method)] for c in (1, 2, 3, 5)], method
    bullet = re.search(r"grouped_mm ÷ fused, median of the 15 per-round ratios, is ([\d., ]+) on",
                       " ".join(section.split()))
    assert bullet is not None
    assert bullet.group(1).split(", ") == [ratios[(f"conf{c}", "grouped_mm")]
                                           for c in (1, 2, 3, 5)]


def test_chunking_time_ratios_equal_the_results_file() -> None:
    ratios = _ratios("chunking", "full_recompute")
    section = _section("MemFine: chunking under routing skew")
    rows = re.findall(r"^\| (\d) \| (.*) \|$", section, flags=re.M)
    assert [skew for skew, _ in rows] == ["1", "2", "4", "8"]
    for skew, cells in rows:
        quoted = [re.search(r"([\d.]+)×", cell).group(1)  # type: ignore[union-attr]
                  for cell in cells.split(" | ")[1:]]
        assert quoted == [ratios[(skew, m)] for m in CHUNKING_COLUMNS], skew


def test_model_step_ratios_equal_the_results_file() -> None:
    ratios = _ratios("model", "fused")
    text = " ".join(_section("A training step of the small model").split())
    quoted = re.search(r"plain ([\d.]+)× the time and \d+ MiB; fused \+ MACT ([\d.]+)× "
                       r"and \d+ MiB; full recompute ([\d.]+)×", text)
    assert quoted is not None
    assert list(quoted.groups()) == [ratios[("small", m)]
                                     for m in ("plain", "fused_mact", "full_recompute")]


def _doc(name: str, start: str) -> str:
    """docs/``name`` from ``start`` to the end of the first table after it."""
    text = (ROOT / "docs" / name).read_text(encoding="utf-8")
    begin = text.index(start)
    table = text.index("\n|", begin)
    return text[begin:text.index("\n\n", table)]


def _table(section: str) -> list[list[str]]:
    """The cells of a markdown table's body rows; an empty first cell repeats the row above's."""
    rows: list[list[str]] = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append(cells if cells[0] or not rows else [rows[-1][0], *cells[1:]])
    return rows[1:]  # the header row left out


def _spread(row: dict[str, str], fmt: str, dash: str) -> str:
    """``p50 (p20<dash>p80)`` of a CSV row, each formatted with ``fmt``."""
    p20, p50, p80 = (format(float(row[q]), fmt) for q in ("p20", "p50", "p80"))
    return f"{p50} ({p20}{dash}{p80})"


def _timed_section(doc: str, start: str, name: str) -> tuple[str, str]:
    """(section, rounds) of docs/``doc`` from ``start`` (:func:`_doc`), once every time row of
    results file ``name`` is checked to be thread CPU time over the rounds the section quotes."""
    section = _doc(doc, start)
    rounds = re.search(r"(?:of|over) the (\d+) (?:per-round ratios|rounds)",
                       " ".join(section.split()))
    assert rounds is not None
    configs = [json.loads(r["config_json"]) for r in _rows(name) if r["metric"] == "time"]
    assert configs
    assert {(c["clock"], c["rounds"]) for c in configs} == {("thread_cpu", int(rounds.group(1)))}
    return section, rounds.group(1)


HF_METHODS = {"eager": "hf_eager", "grouped_mm": "hf_grouped_mm", "memfine": "memfine",
              "memfine, 4 chunks": "memfine_c4"}


def test_hf_doc_experts_table_equals_the_results_file() -> None:
    name = "hf_experts_cpu.csv"
    section, _ = _timed_section("hf.md", "`python benchmarks/bench_hf.py --reps", name)
    times, ratios = _values(name, "time"), _values(name, "time_ratio_to_memfine")
    floor = _values(name, "saved_over_floor")
    rows = _table(section)
    assert len(rows) == len(times) == 8
    for config, method, time_ms, ratio, _, over_floor in rows:
        key = (config.split(":")[0], HF_METHODS[method])
        assert time_ms == f"{float(times[key]['p50']):.1f} ms", key
        expected = _spread(ratios[key], ".2f", "-")
        assert ratio == ("1.00" if key[1] == "memfine" else expected), key
        assert over_floor == f"{float(floor[key]['p50']):.2f}", key


def _quoted(cell: str, value: str) -> str:
    """``value`` (a CSV number) with as many decimals as ``cell`` quotes."""
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return f"{float(value):.{decimals}f}"


def test_hf_doc_suite_table_and_summary_equal_the_results_file() -> None:
    name = "bench_hf.csv"
    section, rounds = _timed_section("hf.md", "`memfine bench --suites hf --threads 1 --repeats",
                                     name)
    ratios, floor = _values(name, "time_ratio_to_memfine"), _values(name, "saved_over_floor")
    rows = _table(section)
    assert len(rows) == 4
    for module, conf, *cells in rows:
        x = f"conf{conf}" + ("-gpt_oss" if module == "GptOssExperts" else "")
        for method, cell in zip(HF_METHODS.values(), cells, strict=True):
            saved, _, time = cell.partition(", ")
            assert saved == _quoted(saved, floor[(x, method)]["p50"]), (x, method)
            if method != "memfine":
                assert time == f"{float(ratios[(x, method)]['p50']):.2f}× time", (x, method)
    text = " ".join((ROOT / "docs" / "hf.md").read_text(encoding="utf-8").split())
    quoted = re.search(r"memfine saves ([\d.]+)–([\d.]+) × the x \+ H floor .*? `eager` saves "
                       r"([\d.]+)–([\d.]+)× and `grouped_mm` ([\d.]+)–([\d.]+)×; .*? medians of "
                       r"(\d+) per-round ratios\) `grouped_mm` takes ([\d.]+)–([\d.]+)× memfine's "
                       r"time and `eager` ([\d.]+)–([\d.]+)×", text)
    assert quoted is not None

    def span(metric: str, method: str, fmt: str) -> list[str]:
        values = [float(r["p50"]) for (_, m), r in _values(name, metric).items() if m == method]
        return [format(min(values), fmt), format(max(values), fmt)]

    expected = [*span("saved_over_floor", "memfine", ".4f"),
                *span("saved_over_floor", "hf_eager", ".2f"),
                *span("saved_over_floor", "hf_grouped_mm", ".2f"), rounds,
                *span("time_ratio_to_memfine", "hf_grouped_mm", ".2f"),
                *span("time_ratio_to_memfine", "hf_eager", ".2f")]
    assert list(quoted.groups()) == expected


TORCHTITAN_CONFIGS = {"qwen3, fp32": "qwen3_fp32", "qwen3, bf16": "qwen3_bf16",
                      "deepseek_v3 (sigmoid, scaled, 2 shared), fp32": "deepseek_v3_fp32",
                      "gpt_oss, bf16": "gpt_oss_bf16"}
TORCHTITAN_METHODS = {"torchtitan": "torchtitan", "memfine": "memfine",
                      "memfine, c = 4": "memfine_c4", "memfine, MACT": "memfine_mact"}


def test_torchtitan_doc_table_equals_the_results_file() -> None:
    name = "torchtitan_cpu.csv"
    section, _ = _timed_section("torchtitan.md", "`python benchmarks/bench_torchtitan.py --reps",
                                name)
    times, ratios = _values(name, "time"), _values(name, "time_ratio_to_torchtitan")
    floor = _values(name, "routed_saved_over_floor")
    rows = _table(section)
    assert len(rows) == len(times) == 16
    for config, method, _, time_ms, ratio, _, _, over_floor, _ in rows:
        key = (TORCHTITAN_CONFIGS[config], TORCHTITAN_METHODS[method])
        p20, p50, p80 = (float(times[key][q]) for q in ("p20", "p50", "p80"))
        assert time_ms == f"{p50:.1f} ms ({p20:.0f}–{p80:.0f})", key
        expected = _spread(ratios[key], ".2f", "–")
        assert ratio == ("1.00" if key[1] == "torchtitan" else expected), key
        assert over_floor == f"{float(floor[key]['p50']):.3f}", key


COMPILE_ROWS = {  # docs/compile.md's table: recipe → provider of compile_cpu.csv
    "eager": "eager_fp32", "`torch.compile` (inductor)": "compiled_fp32",
    "eager, `torch.autocast` bf16, fp32 master weights": "eager_autocast_bf16",
    "eager, backward in blocks of 256 rows": "eager_fp32_blocks",
    "compiled, the same block setting (one block under compile)": "compiled_fp32_blocks",
    "compiled, traced blocks of 256 rows (`STREAM_UNDER_COMPILE`)": "compiled_fp32_streamed",
    "eager, c = 2 with per-chunk recompute": "eager_fp32_c2",
    "compiled, c = 2 with per-chunk recompute": "compiled_fp32_c2"}


def test_compile_doc_times_equal_the_results_file() -> None:
    timed = {r["provider"]: r for r in _rows("compile_cpu.csv") if r["metric"] == "fwd_bwd_s"}
    assert {(r["clock"], r["rounds"]) for r in timed.values()} == {("thread_cpu", "5")}
    rows = _table(_doc("compile.md", "`python benchmarks/bench_compile.py`"))
    assert [recipe for recipe, *_ in rows] == list(COMPILE_ROWS)
    for recipe, time_ms, ratio, _, _ in rows:
        row = timed[COMPILE_ROWS[recipe]]
        assert time_ms == f"{1e3 * float(row['value']):.1f} ms", recipe
        assert ratio == ("1" if recipe == "eager" else f"{float(row['ratio_to_eager_fp32']):.3f}")
