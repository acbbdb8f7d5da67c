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
    assert runner.script_main("experts", tmp_path, ["--quick"]) == 1  # a failed method
    assert runner.script_main("chunking", tmp_path, ["--repeats", "3", "--threads", "2",
                                                     "--out", str(tmp_path / "x")]) == 1
    (quick, device), (full, _) = seen
    assert device.type == "cpu"
    assert (quick.suites, quick.repeats, quick.warmup, quick.threads, quick.quick, quick.out) == (
        ("experts",), 1, 0, 1, True, str(tmp_path))
    assert (full.suites, full.repeats, full.warmup, full.threads, full.out) == (
        ("chunking",), 3, 1, 2, str(tmp_path / "x"))


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
