"""scripts/run_peft_tests.sh's own flags: --help and a missing python (PEFT's tests not run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_peft_tests.sh"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PY": str(tmp_path / "no-python"),
           "PEFT_TESTS_DIR": str(tmp_path / "work")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=30, check=False)


def test_help_prints_the_usage_and_runs_nothing(tmp_path: Path) -> None:
    result = _run("--help", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage:\n")
    assert "--peft-src DIR" in result.stdout and "PEFT_TESTS_DIR" in result.stdout
    assert "datasets and" in result.stdout and "diffusers" in result.stdout  # the whole block
    assert not (tmp_path / "work").exists()


def test_a_missing_python_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _run("-k", "merge", tmp_path=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "PY=" in lines[0] and "no-python" in lines[0], result.stderr
    assert not (tmp_path / "work").exists()
