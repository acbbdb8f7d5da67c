"""scripts/gpu_check.sh's helpers on the CPU where torchtitan cannot be imported.

The dry run (CI) runs them with torchtitan installed; here torchtitan is blocked
(``sys.modules["torchtitan"] = None``) and its rows must say ``skipped`` with the reason, and the
script print the line, rather than fail or leave the rows out silently.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import timeouts

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TINY = ["--device", "cpu", "--tokens", "32", "--hidden-size", "16", "--intermediate-size", "8",
        "--num-experts", "4", "--top-k", "2"]


def _run_without_torchtitan(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = ("import runpy, sys; sys.modules['torchtitan'] = None; "
            f"sys.argv = {[script, *args]!r}; "
            f"raise SystemExit(runpy.run_path({str(SCRIPTS / script)!r}, run_name='__main__'))")
    return timeouts.run([sys.executable, "-c", code], 300, capture_output=True)


def _rows(path: Path, part: str, name: str) -> list[list[str]]:
    with path.open(newline="") as f:
        return [r for r in csv.reader(f) if r[:2] == [part, name]]


def test_environment_row_and_line_say_torchtitan_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.csv"
    proc = _run_without_torchtitan("gpu_check_csv.py", str(out), "environment")
    assert proc.returncode == 0, proc.stderr
    assert "torchtitan: skipped" in proc.stdout and "pip install" in proc.stdout
    (row,) = _rows(out, "environment", "torchtitan")
    assert row[2] == "skipped" and "torchtitan" in row[6]


def test_equality_has_a_skipped_torchtitan_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.csv"
    proc = _run_without_torchtitan("gpu_check_equal.py", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    (row,) = _rows(out, "equality", "torchtitan")
    assert row[2] == "skipped" and "pip install 'memfine[torchtitan]'" in row[6]
    assert len(_rows(out, "equality", "plain_grouped_mm")) == 3  # the other methods still ran


def test_docs_table_lists_the_script_parts_in_order_with_their_timeouts() -> None:
    """docs/gpu.md's table: the parts ``gpu_check.sh`` runs, in its order, with its timeouts."""
    script = (SCRIPTS / "gpu_check.sh").read_text()
    dry_peak, gpu_peak = re.findall(r"PEAK_LIMIT=(\d+)", script)  # the dry-run branch first
    runs = re.findall(r"^\s*run (\w+) (\S+) ", script, re.MULTILINE)
    parts = [(part, gpu_peak if limit == '"$PEAK_LIMIT"' else limit) for part, limit in runs]
    doc = (SCRIPTS.parent / "docs" / "gpu.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (\d+) s \|(.*)$", doc, re.MULTILINE)
    assert [(part, limit) for part, limit, _ in rows] == parts
    peak = next(rest for part, _, rest in rows if part == "peak")
    assert f"{dry_peak} s" in peak
    total = sum(int(limit) for _, limit in parts)
    dry = total - int(dict(parts)["install"]) - int(gpu_peak) + int(dry_peak)
    assert f"sum to {total} s" in doc and f"({dry} s in all)" in doc
    assert f"the part timeouts sum to {total} s" in script
