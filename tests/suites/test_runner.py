"""The benchmark scripts are thin: one suite each through memfine.bench, never memfine.cli."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from memfine.bench.options import BenchOptions
from memfine.suites import runner

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def test_script_main_runs_one_suite_with_its_flags(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    seen: list[tuple[BenchOptions, torch.device]] = []
    monkeypatch.setattr(runner, "run_suites", lambda opts, device: seen.append((opts, device))
                        or ["experts 1 fused: boom"])
    monkeypatch.setattr("memfine.flags.threads.usable_cpus", lambda: 4)
    assert runner.script_main("experts", tmp_path, ["--quick"]) == 1  # a failed method
    assert runner.script_main("chunking", tmp_path, ["--repeats", "3", "--threads", "2",
                                                     "--out", str(tmp_path / "x")]) == 1
    (quick, device), (full, _) = seen
    assert device.type == "cpu"
    assert (quick.suites, quick.repeats, quick.warmup, quick.threads, quick.quick, quick.out) == (
        ("experts",), 1, 0, 1, True, str(tmp_path))
    assert (full.suites, full.repeats, full.warmup, full.threads, full.out) == (
        ("chunking",), 3, 1, 2, str(tmp_path / "x"))


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["--repeats", "-3"], "argument --repeats: expected an integer >= 1, got -3"),
    (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
    (["--threads", "-2"], "argument --threads: expected an integer >= 1, got -2"),
    (["--repeats", "1e3"], "argument --repeats: expected an integer, got '1e3'"),
    *(([flag, str(10**20)], f"argument {flag}: expected an integer in [-2**63, 2**63 - 1] "
       f"(int64), got {10**20}") for flag in ("--repeats", "--warmup", "--threads")),
])
def test_script_main_refuses_counts_out_of_range_naming_the_flag(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        argv: list[str], message: str) -> None:
    monkeypatch.setattr(runner, "run_suites", lambda opts, device: pytest.fail("ran"))
    with pytest.raises(SystemExit) as info:
        runner.script_main("experts", tmp_path, argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


def test_script_main_lowers_threads_to_the_cpus(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    seen: list[BenchOptions] = []
    monkeypatch.setattr(runner, "run_suites", lambda opts, device: seen.append(opts) or [])
    monkeypatch.setattr("memfine.flags.threads.usable_cpus", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert runner.script_main("experts", tmp_path, ["--threads", str(2**40)]) == 0
    assert seen[0].threads == 2
    assert (f"warning: --threads {2**40} is more than the 2 CPU(s) this process may use; "
            f"using 2") in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_scripts_do_not_import_the_cli(script: str) -> None:
    tree = ast.parse((BENCHMARKS / script).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("memfine.cli")]


@pytest.mark.parametrize(("script", "suite"), [
    ("bench_experts.py", "experts"), ("bench_memfine.py", "chunking"), ("bench_model.py", "model")])
def test_suite_scripts_are_thin(script: str, suite: str) -> None:
    """The script calls script_main with its suite and defines nothing of its own."""
    tree = ast.parse((BENCHMARKS / script).read_text())
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "script_main"]
    assert len(calls) == 1 and ast.literal_eval(calls[0].args[0]) == suite


def test_counts_script_takes_bench_counts_flags(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    """--tokens and --count-device reach the options, as with memfine bench --suites counts."""
    seen: list[BenchOptions] = []
    monkeypatch.setattr(runner, "run_suites", lambda opts, device: seen.append(opts) or [])
    assert runner.script_main("counts", tmp_path, ["--tokens", "512",
                                                   "--count-device", "cpu"]) == 0
    assert (seen[0].tokens, seen[0].count_device, seen[0].suites) == (512, "cpu", ("counts",))
    with pytest.raises(SystemExit) as info:
        runner.script_main("counts", tmp_path, ["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "memfine bench --suites counts" in text and "--count-device {cuda,cpu}" in text
    with pytest.raises(SystemExit) as info:  # T below k: the suite's shapes refuse it
        runner.script_main("counts", tmp_path, ["--tokens", "4"])
    assert info.value.code == 2 and "--tokens" in capsys.readouterr().err.splitlines()[-1]
    assert len(seen) == 1


def test_scripts_keep_earlier_results_without_overwrite(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    """As memfine bench: bench_* files in --out stop the run unless --overwrite is given."""
    seen: list[BenchOptions] = []
    monkeypatch.setattr(runner, "run_suites", lambda opts, device: seen.append(opts) or [])
    (tmp_path / "bench_counts.csv").write_text("kept\n")
    for argv in (["--quick"], ["--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as info:
            runner.script_main("counts", tmp_path, argv)
        assert info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(
            f"error: --out {str(tmp_path)!r} already holds results (bench_counts.csv); pass "
            f"--overwrite to replace them or choose another --out")
    assert not seen and (tmp_path / "bench_counts.csv").read_text() == "kept\n"
    assert runner.script_main("counts", tmp_path, ["--quick", "--overwrite"]) == 0
    assert runner.script_main("experts", tmp_path / "new", []) == 0
    assert len(seen) == 2
