"""``memfine bench``: the flag set, the shapes, and smoke runs that check files and columns.

The smoke runs check what was written and exact invariants (the memory model equals the
measurement on the CPU; MACT stays inside its budget), never timings.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from memfine._optional import is_available
from memfine.bench.harness import MODES, MethodResult
from memfine.bench.options import BenchOptions, resolve_shapes, table1_shape
from memfine.bench.output import clock_text, format_plain, table_rows
from memfine.bench.results import CSV_COLUMNS, NOT_MODELLED
from memfine.cli import bench
from memfine.cli.main import main
from memfine.measure.report import NOT_MEASURED
from memfine.suites import experts, select_methods

BENCH_FLAGS = {
    "--suites", "--configs", "--scale-down", "--tokens", "--hidden-size", "--intermediate-size",
    "--num-experts", "--top-k", "--dtype", "--threads", "--repeats", "--warmup", "--out",
    "--quick", "--overwrite", "--methods", "--memory-budget", "--skew-levels", "--device",
    "--seed", "--compile", "--compile-backend", "--count-device", "-h", "--help",
    "--suite", "--config", "--budget",  # hidden aliases of --suites, --configs, --memory-budget
}
MEMORY_METRICS = ("saved_bytes", "saved_bytes_predicted", "peak_bytes", "peak_bytes_predicted")
Table = dict[str, dict[str, dict[str, str]]]


def test_bench_flag_set_is_pinned() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags = {s for action in parser._actions for s in action.option_strings}
    assert flags == BENCH_FLAGS


def _read(path: Path) -> tuple[tuple[str, ...], Table]:
    """CSV header and ``{x_value/method: {metric/mode: row}}``."""
    with path.open() as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        header = tuple(reader.fieldnames or ())
    table: Table = defaultdict(dict)
    for r in rows:
        table[f"{r['x_value']}/{r['method']}"][f"{r['metric']}/{r['mode']}"] = r
    return header, table


def _run(tmp_path: Path, *argv: str) -> Path:
    assert main(["bench", "--quick", "--out", str(tmp_path), *argv]) == 0
    return tmp_path


def test_experts_quick_writes_csv_and_plots(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out = _run(tmp_path, "--suite", "experts")
    assert torch.get_num_threads() == threads  # --quick runs on 1 thread, then restores
    header, table = _read(out / "bench_experts.csv")
    assert header == CSV_COLUMNS
    runnable = [m for m in experts.METHODS if m not in experts.skipped_methods(experts.METHODS)]
    assert set(table) == {f"quick/{m}" for m in runnable}  # torchtitan: where it imports
    for name in runnable:
        rows = table[f"quick/{name}"]
        for key in ("time/fwd", "time/bwd", "time/full", "tokens_per_s/full", "saved_bytes/fwd",
                    "peak_bytes/full", "saved_bytes_predicted/fwd", "peak_bytes_predicted/full"):
            assert key in rows, (name, key)
        assert rows["time/full"]["unit"] == "ms"
        assert rows["peak_bytes/full"]["unit"] == "bytes"
        assert rows["tokens_per_s/full"]["unit"] == "tokens/s"
        assert rows["time/full"]["threads"].isdigit()
        config = json.loads(rows["time/full"]["config_json"])
        assert (config["tokens"], config["clock"]) == (64, "thread_cpu")  # one thread
        assert rows["time_ratio_to_fused/full"]["unit"] == "ratio"
        assert float(rows["time_ratio_to_fused/full"]["p50"]) > 0
    assert {table["quick/fused"][f"time_ratio_to_fused/{m}"]["p50"] for m in MODES} == {"1"}
    # The memory model is exact on the CPU for the methods it covers.
    for name in ("plain", "grouped_mm", "fused", "fused_mact"):
        rows = table[f"quick/{name}"]
        for item, mode in (("saved_bytes", "fwd"), ("peak_bytes", "full")):
            assert rows[f"{item}/{mode}"]["p50"] == rows[f"{item}_predicted/{mode}"]["p50"], name
    for name in ("expert_loop", "full_recompute"):
        assert table[f"quick/{name}"]["peak_bytes_predicted/full"]["p50"] == NOT_MODELLED
    saved = {n: int(table[f"quick/{n}"]["saved_bytes/fwd"]["p50"]) for n in runnable}
    assert saved["fused"] < saved["grouped_mm"] == saved["plain"]
    assert saved["fused_mact"] < saved["fused"]
    # the budget is c = 2's predicted peak; at this tiny shape the unchunked layer (each block's
    # H freed once its dH exists) peaks below it, so MACT keeps c = 1
    assert int(table["quick/fused_mact"]["num_chunks/full"]["p50"]) == 1
    for kind in ("time", "memory", "predicted"):
        assert (out / f"bench_experts_{kind}.png").stat().st_size > 0
    config = json.loads((out / "bench_config.json").read_text())
    options = config["options"]
    assert (options["quick"], options["repeats"], options["warmup"], options["threads"]) == (
        True, 1, 0, 1)
    assert config["environment"]["threads"] == 1


def _compiled_column(table: Table, x_value: str, eager: str) -> dict[str, dict[str, str]]:
    """The compiled method's rows, checked against its eager method's (no timing values)."""
    rows, eager_rows = table[f"{x_value}/{eager}_compiled"], table[f"{x_value}/{eager}"]
    assert rows["time/full"]["unit"] == "ms" and rows["time/full"]["p50"] != NOT_MEASURED
    # Peak from torch.profiler (the tracker cannot see inductor's buffers); not modelled.
    assert rows["peak_bytes/full"]["p50"] == rows["profiler_peak_bytes/full"]["p50"]
    assert int(rows["peak_bytes/full"]["p50"]) > 0
    assert rows["peak_bytes_predicted/full"]["p50"] == NOT_MODELLED
    assert rows["num_chunks/full"]["p50"] == eager_rows["num_chunks/full"]["p50"]
    return rows


def test_experts_quick_compiled_column(tmp_path: Path) -> None:
    """``fused_compiled`` named in --methods (aot_eager: traced, no code generation)."""
    out = _run(tmp_path, "--suite", "experts", "--methods", "fused", "fused_compiled",
               "--compile-backend", "aot_eager")
    header, table = _read(out / "bench_experts.csv")
    assert header == CSV_COLUMNS
    assert set(table) == {"quick/fused", "quick/fused_compiled"}
    rows = _compiled_column(table, "quick", "fused")
    # The compiled graph saves x and H as the fused Function does; the index arrays it keeps
    # may differ (a few hundred bytes of int64 here), so compare the floating part's floor.
    T, d, n, k = 64, 64, 128, 2
    assert int(rows["saved_bytes/fwd"]["p50"]) >= 4 * (T * d + 2 * T * k * n)
    options = json.loads((out / "bench_config.json").read_text())["options"]
    assert (options["compile"], options["compile_backend"]) == (False, "aot_eager")


@pytest.mark.slow
def test_model_quick_compiled_column_inductor(tmp_path: Path) -> None:
    out = _run(tmp_path, "--suite", "model", "--methods", "fused", "fused_mact", "--compile")
    _, table = _read(out / "bench_model.csv")
    assert set(table) == {f"tiny/{m}" for m in ("fused", "fused_mact", "fused_compiled",
                                                "fused_mact_compiled")}
    for eager in ("fused", "fused_mact"):
        _compiled_column(table, "tiny", eager)


def test_chunking_quick_mact_within_budget(tmp_path: Path) -> None:
    out = _run(tmp_path, "--suite", "chunking", "--skew-levels", "1,8",
               "--methods", "mact", "no_recompute")
    _, table = _read(out / "bench_chunking.csv")
    chunks = {s: int(table[f"{s}/mact"]["num_chunks/full"]["p50"]) for s in ("1", "8")}
    assert chunks == {"1": 1, "8": 8}
    for skew in ("1", "8"):
        rows = table[f"{skew}/mact"]
        assert int(rows["peak_bytes/full"]["p50"]) <= int(rows["budget_bytes/full"]["p50"])
        assert float(rows["peak_over_budget/full"]["p50"]) <= 1.0
    assert (out / "bench_chunking_skew.png").stat().st_size > 0


def test_model_quick_full_recompute_saves_less(tmp_path: Path) -> None:
    out = _run(tmp_path, "--suite", "model", "--methods", "fused", "full_recompute")
    _, table = _read(out / "bench_model.csv")
    saved = {n: int(table[f"tiny/{n}"]["saved_bytes/fwd"]["p50"])
             for n in ("fused", "full_recompute")}
    assert saved["full_recompute"] < saved["fused"]
    assert table["tiny/fused"]["saved_bytes_predicted/fwd"]["p50"] == NOT_MODELLED


@pytest.mark.skipif(not is_available("transformers"), reason="transformers not installed")
def test_hf_quick_memfine_saves_less_than_eager(tmp_path: Path) -> None:
    out = _run(tmp_path, "--suite", "hf", "--methods", "hf_eager", "memfine")
    _, table = _read(out / "bench_hf.csv")
    saved = {n: int(table[f"quick/{n}"]["saved_bytes/fwd"]["p50"]) for n in ("hf_eager", "memfine")}
    assert saved["memfine"] < saved["hf_eager"]
    # GPT-OSS (biases, clamped interleaved SwiGLU) on the fused path: x, H, the routing weights
    # and int32 indices, exactly; the floor is x + H (T·d + 2·T·k·n elements, fp32).
    T, d, n, E, k = 64, 64, 128, 4, 2
    gpt_oss = table["quick-gpt_oss/memfine"]
    saved_bytes = int(gpt_oss["saved_bytes/fwd"]["p50"])
    assert saved_bytes == 4 * (T * d + 2 * T * k * n + T * k) + 4 * (3 * T * k + E + 1)
    assert float(gpt_oss["saved_over_floor/full"]["p50"]) <= 1.02
    assert saved_bytes < int(table["quick-gpt_oss/hf_eager"]["saved_bytes/fwd"]["p50"])


def test_unknown_method_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--out", str(tmp_path), "--methods", "nope"])
    assert exit_info.value.code == 2
    assert "--methods: unknown ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--top-k", "9", "--num-experts", "4"], "--top-k 9 must be at most --num-experts 4"),
    (["--top-k", "9"], "--top-k must be at most --num-experts: the quick shape has k 9 and E 4"),
    (["--suites", "counts", "--top-k", "9", "--num-experts", "4"],
     "--top-k 9 must be at most --num-experts 4"),
    (["--suites", "counts", "--num-experts", "4"],
     "--top-k must be at most --num-experts: the qwen3-30b-a3b preset would have k 8 and E 4"),
    (["--suites", "chunking", "--top-k", "9"],
     "--top-k must be at most --num-experts: the quick shape has k 9 and E 4"),
    (["--suites", "model", "--top-k", "9"],
     "--top-k must be at most --num-experts: the model has k 9 and E 4"),
    (["--suites", "counts", "--tokens", "3"], "--tokens must be an int in [8, 65536] for the "
     "counts suite (T·k rows are held on the CPU), got 3"),
])
def test_k_above_e_is_one_line_and_writes_nothing(args: list[str], message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--suites", "experts", "--out", str(out), *args])
    assert exit_info.value.code == 2
    printed, err = capsys.readouterr()
    assert err.strip() == f"memfine bench: error: {message}"
    assert printed == ""  # not even the options line
    assert not out.exists()


# --- shapes and table ---------------------------------------------------------------------------

def test_table1_scaled_down() -> None:
    shape = table1_shape(3, 256)
    assert (shape.tokens, shape.hidden_size, shape.intermediate_size, shape.num_experts,
            shape.top_k, shape.paper_tokens) == (256, 1024, 4096, 16, 4, 32 * 2048)
    assert shape.floor_bytes(4) == (256 * 1024 + 2 * 256 * 4 * 4096) * 4


def test_resolve_shapes_overrides() -> None:
    quick, defaults = experts.QUICK, [table1_shape(2, 256)]
    opts = BenchOptions(configs=(1, 5), tokens=100)
    assert [(s.name, s.tokens, s.hidden_size) for s in resolve_shapes(opts, defaults, quick)] == [
        ("conf1", 100, 512), ("conf5", 100, 512)]
    custom = resolve_shapes(BenchOptions(hidden_size=256), defaults, quick)
    assert [(s.name, s.hidden_size, s.intermediate_size, s.num_experts) for s in custom] == [
        ("custom", 256, 1024, 8)]
    assert resolve_shapes(BenchOptions(), defaults, quick) == defaults
    assert resolve_shapes(BenchOptions(quick=True, top_k=1), defaults, quick)[0].top_k == 1
    with pytest.raises(ValueError, match="--top-k must be at most --num-experts: the conf1 shape"):
        resolve_shapes(BenchOptions(configs=(1,), top_k=5), defaults, quick)


@pytest.mark.parametrize("kwargs, match", [
    ({"suites": ("nope",)}, r"BenchOptions.suites must be"),
    ({"configs": (9,)}, r"BenchOptions.configs must be Table 1 rows"),
    ({"repeats": 0}, r"BenchOptions.repeats must be an int >= 1, got 0"),
    ({"skew_levels": (4, 2)}, r"BenchOptions.skew_levels must be strictly increasing"),
    ({"compile_backend": "eager"}, r"BenchOptions.compile_backend must be one of \('inductor', "
                                   r"'aot_eager'\), got 'eager'"),
], ids=["suite", "config", "repeats", "skew_levels", "compile_backend"])
def test_options_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BenchOptions(**kwargs)  # type: ignore[arg-type]


def test_select_methods() -> None:
    assert select_methods("experts", ()) == experts.METHODS
    assert select_methods("experts", ("fused", "mact")) == ("fused",)
    assert select_methods("chunking", ("fused",)) == ()


def test_select_methods_with_compile() -> None:
    compiled = ("fused_compiled", "fused_mact_compiled")
    assert select_methods("experts", (), compile=True) == (*experts.METHODS, *compiled)
    assert select_methods("experts", ("fused", "plain"), compile=True) == (
        "plain", "fused", "fused_compiled")
    assert select_methods("experts", ("fused_mact_compiled",)) == ("fused_mact_compiled",)
    assert select_methods("model", ("fused_mact",), compile=True) == (
        "fused_mact", "fused_mact_compiled")
    assert select_methods("chunking", ("mact",), compile=True) == ("mact",)


def test_table_rows_show_missing_and_failed() -> None:
    from memfine.bench.options import Point

    failed = MethodResult(name="grouped_mm", error="RuntimeError: strides")
    unmeasured = MethodResult(name="fused")
    point = Point(suite="experts", x_name="shape", x_value="quick", label="quick", config={},
                  results=[failed, unmeasured], reference="fused")
    rows = table_rows(point)
    assert rows[0][1] == "failed: RuntimeError: strides"
    assert rows[1][1] == NOT_MEASURED and rows[1][5] == NOT_MEASURED
    assert rows[1][6] == NOT_MODELLED
    assert clock_text(point.results) == "no clock"
    text = format_plain("title", ("a", "bb"), [("xxx", "y")])
    assert text.splitlines() == ["title", "a    bb", "xxx  y"]


def test_table_ratio_is_the_median_of_per_round_ratios() -> None:
    from memfine.bench.options import Point

    fused = MethodResult(name="fused", clock="thread_cpu")
    fused.times_s["full"] = [1.0, 4.0, 4.0]
    gmm = MethodResult(name="grouped_mm", clock="thread_cpu")
    gmm.times_s["full"] = [4.0, 2.0, 8.0]  # per round 4, 0.5, 2; p50s 4 ÷ 4 would read 1.00
    point = Point(suite="experts", x_name="shape", x_value="c", label="c", config={},
                  results=[fused, gmm], reference="fused")
    assert [(r[0], r[1], r[3]) for r in table_rows(point)] == [
        ("fused", "4000.0", "1.00"), ("grouped_mm", "4000.0", "2.00")]
    assert clock_text(point.results) == "thread CPU time (time.thread_time)"
    gmm.clock = "wall"
    assert clock_text(point.results) == ("thread CPU time (time.thread_time), "
                                         "wall clock (time.perf_counter)")


def test_a_failing_method_makes_the_exit_code_non_zero(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "_check_budget", lambda opts, device: None)  # fail at run time
    code = main(["bench", "--suite", "experts", "--quick", "--methods", "fused", "fused_mact",
                 "--budget", "1KiB", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "method failed: experts quick fused_mact: InfeasibleBudgetError" in err
    assert "smallest feasible budget" in err


@pytest.mark.parametrize(("flag", "text", "message"), [
    ("--threads", "0", "--threads must be an int >= 1, got 0"),  # no "or None": not typeable
    ("--repeats", "0", "--repeats must be an int >= 1, got 0"),
    ("--tokens", "0", "--tokens must be an int >= 1, got 0"),
    ("--warmup", "-1", "--warmup must be an int >= 0, got -1"),
])
def test_bad_option_names_the_flag_as_typed(flag: str, text: str, message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", flag, text, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"memfine bench: error: {message}\n"
    assert not list(tmp_path.iterdir())


def test_earlier_results_are_kept_without_overwrite(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bench_experts.csv").write_text("earlier results\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--suites", "model", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "already holds results (bench_experts.csv); pass --overwrite" in (
        capsys.readouterr().err)
    assert (tmp_path / "bench_experts.csv").read_text() == "earlier results\n"


@pytest.mark.parametrize("sub", ["", "sub"])
def test_out_that_is_or_lies_under_a_file(tmp_path: Path, sub: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--quick", "--out", str(blocker / sub if sub else blocker)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "is not a directory; give a directory" in err
    assert blocker.read_text() == "x"


CHUNKING_NEED = 730444
"""Bytes: the least budget of the chunking suite's quick skew-8 layer call (c = 8)."""


@pytest.mark.parametrize(("suite", "point", "need"), [
    ("chunking", "skew 8x's MoE layer call (512 rows)", CHUNKING_NEED),
    ("experts", "quick's MoE layer call (128 rows)", None),
    ("model", "MoE LM's MoE layer call (512 rows)", None),
])
def test_a_budget_no_bin_meets_is_one_line_before_anything_runs(
        suite: str, point: str, need: int | None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--suites", suite, "--quick", "--memory-budget", "1B",
              "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "out").exists()
    assert err.startswith("memfine bench: error: --memory-budget 1 bytes (0.00 MiB) cannot be "
                          f"met by any chunk count in the bins 1,2,4,8: {suite} {point}")
    assert err.count("\n") == 1 and "--allow-over-budget" not in err and "bin to" not in err
    assert err.endswith("; raise --memory-budget\n")
    if need is not None:  # the layer's own number at run time (see the next test)
        assert f"the smallest feasible budget is {need} bytes" in err


def test_the_budget_check_is_the_layers_own(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """At run time the chunking suite's worst skew level fails with the same smallest budget."""
    monkeypatch.setattr(bench, "_check_budget", lambda opts, device: None)
    assert main(["bench", "--suites", "chunking", "--quick", "--memory-budget", "1B",
                 "--methods", "mact", "--skew-levels", "8", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"the smallest feasible budget is {CHUNKING_NEED} bytes" in err
    assert "bin to" not in err and "ChunkConfig" not in err and "raise --memory-budget" in err
