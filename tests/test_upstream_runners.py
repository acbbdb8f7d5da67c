"""The upstream-test runners' own flags: --help and a missing python (no upstream test run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "scripts" / "run_peft_tests.sh", ROOT / "scripts" / "run_hf_model_tests.sh"]


def _run(script: Path, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PY": str(tmp_path / "no-python"),
           "PEFT_TESTS_DIR": str(tmp_path / "work"), "HF_TESTS_DIR": str(tmp_path / "work")}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          env=env, timeout=30, check=False)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_help_prints_the_usage_and_runs_nothing(script: Path, tmp_path: Path) -> None:
    result = _run(script, "--help", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage:\n")
    assert f"scripts/{script.name}" in result.stdout and "Env: PY" in result.stdout
    assert "\nNeeds: " in result.stdout and not result.stdout.rstrip().endswith("Needs:")
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_a_missing_python_is_one_line_and_exit_2(script: Path, tmp_path: Path) -> None:
    result = _run(script, "-x", tmp_path=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "PY=" in lines[0] and "no-python" in lines[0], result.stderr
    assert not (tmp_path / "work").exists()
