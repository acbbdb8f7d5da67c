"""``memfine bench`` as a user meets it: flags a suite does not read, tables printed to a pipe or
a terminal, and ``--overwrite`` replacing every file of an earlier run."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from memfine.bench import output
from memfine.bench.harness import MethodResult
from memfine.bench.options import BenchOptions, Point
from memfine.cli import bench
from memfine.cli.main import main

COUNTS_FAST = ["--suites", "counts", "--tokens", "32", "--num-experts", "16",
               "--methods", "fused", "torchtitan_style"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``memfine argv``; assert exit 2, one stderr line, nothing on stdout; return the line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "", err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


# -- flags the counts suite does not read --------------------------------------------------


@pytest.mark.parametrize(("typed", "shown", "why"), [
    (["--dtype", "float32"], "--dtype float32", "it counts bfloat16 layers"),
    (["--budget", "1GiB"], "--memory-budget 1073741824 bytes (1.00 GiB)",
     "its mact method's budget is its own"),
    (["--repeats", "3"], "--repeats 3", "it counts each method once"),
    (["--hidden-size", "64"], "--hidden-size 64", "it counts at its presets' d and n"),
    (["--configs", "1", "2"], "--configs 1 2", "its shapes are its presets"),
    (["--skew-levels", "1,2"], "--skew-levels 1,2", "it routes as its presets do"),
    (["--compile"], "--compile", "it has no compiled methods"),
    (["--threads", "2"], "--threads 2", "op and sync counts do not depend on torch's threads"),
])
def test_counts_refuses_a_flag_it_does_not_read(typed: list[str], shown: str, why: str,
                                                tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["bench", *COUNTS_FAST, *typed, "--out", str(tmp_path / "o")], capsys)
    assert line.startswith(f"memfine bench: error: {shown}: the counts suite does not read it: "
                           f"{why}"), line
    assert line.endswith("drop it, or add a suite that reads it to --suites")
    assert not (tmp_path / "o").exists()


def test_a_flag_another_selected_suite_reads_is_kept(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dtype`` with counts and experts: experts reads it; ``--memory-budget auto`` is every
    suite's own budget."""
    seen: list[BenchOptions] = []
    monkeypatch.setattr(bench, "run_suites", lambda opts, device: seen.append(opts) or [])
    assert main(["bench", "--suites", "counts", "experts", "--quick", "--dtype", "bfloat16",
                 "--out", str(tmp_path)]) == 0
    assert main(["bench", "--suites", "counts", "--memory-budget", "auto",
                 "--out", str(tmp_path)]) == 0
    # counts alone with --dtype bfloat16: what it counts anyway, so not refused
    assert main(["bench", "--suites", "counts", "--dtype", "bfloat16",
                 "--out", str(tmp_path)]) == 0
    assert [o.dtype for o in seen] == ["bfloat16", "float32", "bfloat16"]


def test_methods_of_no_selected_suite_are_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--methods plain`` with counts alone would run nothing: refused, naming counts' methods."""
    line = _usage_error(["bench", "--suites", "counts", "--methods", "plain", "--out",
                         str(tmp_path / "o")], capsys)
    from memfine.suites import counts
    assert line.startswith("memfine bench: error: --methods plain: no method of the counts "
                           f"suite (counts has {', '.join(counts.METHODS)}); pick from those"), line
    assert not (tmp_path / "o").exists()
    line = _usage_error(["bench", "--suites", "counts", "chunking", "--methods", "plain"], capsys)
    assert "no method of the counts and chunking suites (counts has fused, " in line, line
    assert "; chunking has " in line


def test_help_says_counts_do_not_read_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "the counts suite counts bf16 and does not read it" in text, text


def test_counts_alone_record_the_bf16_they_ran(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """bench_config.json, the printed options and every CSV row say bfloat16, not the float32
    default of --dtype that counts does not read."""
    assert main(["bench", *COUNTS_FAST, "--out", str(tmp_path)]) == 0
    options = json.loads((tmp_path / "bench_config.json").read_text())["options"]
    assert options["dtype"] == "bfloat16"
    printed = capsys.readouterr().out.splitlines()[0].removeprefix("memfine bench ")
    assert json.loads(printed)["dtype"] == "bfloat16"
    with (tmp_path / "bench_counts.csv").open() as f:
        configs = [json.loads(row["config_json"]) for row in csv.DictReader(f)]
    assert configs and {c["dtype"] for c in configs} == {"bfloat16"}


# -- tables: no line ends in spaces -------------------------------------------------------


def _point() -> Point:
    fused = MethodResult(name="fused", tokens=64, clock="thread_cpu")
    fused.times_s["full"] = [1.0, 2.0]
    failed = MethodResult(name="grouped_mm", error="RuntimeError: x")
    return Point(suite="experts", x_name="shape", x_value="quick",
                 label="quick: d=64 n=128 E=4 k=2 T=64 float32", config={},
                 results=[fused, failed], reference="fused")


@pytest.mark.parametrize("where", ["pipe", "terminal", "plain"])
def test_table_lines_do_not_end_in_spaces(where: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """rich on a pipe and on a terminal (colours forced), and the plain table without rich."""
    if where == "terminal":
        monkeypatch.setenv("FORCE_COLOR", "1")
    if where == "plain":
        find_spec = output.importlib.util.find_spec
        monkeypatch.setattr(output.importlib.util, "find_spec",
                            lambda name, *a: None if name == "rich" else find_spec(name, *a))
    output.print_point(_point())
    text = capsys.readouterr().out
    if where == "terminal":
        assert ANSI.search(text)
    lines = ANSI.sub("", text).splitlines()
    assert lines[0] == f"[experts] {_point().label}"
    assert any("method" in line and "fwd+bwd ms" in line for line in lines)
    assert [line for line in lines if line != line.rstrip()] == []


def test_counts_table_lines_do_not_end_in_spaces(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *COUNTS_FAST, "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("torchtitan_style ") for line in lines)  # no syncs: no kinds
    assert [line for line in lines if line != line.rstrip()] == []


# -- --overwrite ---------------------------------------------------------------------------


def test_overwrite_replaces_the_run_config_too(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Run twice into one --out with other options: every file is the second run's."""
    argv = ["bench", "--suites", "experts", "--quick", "--out", str(tmp_path)]
    assert main([*argv, "--methods", "fused", "--seed", "1"]) == 0
    first_csv = (tmp_path / "bench_experts.csv").read_text()
    assert main([*argv, "--methods", "plain", "fused", "--seed", "2", "--overwrite"]) == 0
    options = json.loads((tmp_path / "bench_config.json").read_text())["options"]
    assert options["seed"] == 2 and options["methods"] == ["plain", "fused"]
    assert (tmp_path / "bench_experts.csv").read_text() != first_csv
    assert ",plain," in (tmp_path / "bench_experts.csv").read_text()
