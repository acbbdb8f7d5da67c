"""scripts/gpu_check.sh's runner with stub parts: bad input, its files, budgets and kills.

The parts are replaced by small Python stubs (the real ones take minutes on the CPU: CI's image
lane, scripts/ci_image_lane.sh, runs them); the runner itself is the committed one. The probe of
the python is replaced by a fixed answer unless a test is about it.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import timeouts

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_check  # noqa: E402
import gpu_check_csv  # noqa: E402

STUB = """
import os, subprocess, sys, time
mode, work, part, pids = sys.argv[1:5]
(open(os.path.join(work, "evidence.csv"), "a").write(f"row,{part}\\n"))
if mode == "hang":  # a grandchild in the part's group, then past the budget
    child = subprocess.Popen(["sleep", "1000"])
    open(pids, "w").write(f"{os.getpid()} {child.pid}\\n")
    time.sleep(1000)
"""
RUNNER = """
import sys
sys.path.insert(0, {scripts!r})
import gpu_check
gpu_check.probe = lambda py, env: {{"torch": "x", "cuda": False, "python": "3"}}
gpu_check.budgets = lambda total: {{p.name: {limit} for p in gpu_check.PARTS}}
modes = {modes!r}
gpu_check.commands = lambda dry, work, py: {{
    p.name: [py, {stub!r}, modes.get(p.name, "ok"), str(work), p.name, {pids!r}]
    for p in gpu_check.PARTS}}
sys.exit(gpu_check.main(sys.argv[1:]))
"""


def _runner(tmp_path: Path, modes: dict[str, str], limit: int, *args: str) -> subprocess.Popen:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    code = RUNNER.format(scripts=str(SCRIPTS), limit=limit, modes=modes, stub=str(stub),
                         pids=str(tmp_path / "pids"))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _parts(out: Path) -> dict[str, str]:
    with (out / gpu_check.SUMMARY).open(newline="") as f:
        return {r["part"]: r["status"] for r in csv.DictReader(f) if r["metric"] == "wall_time"}


@pytest.mark.parametrize(("args", "flag"), [
    (["--budget", "10"], "--budget 10: below the minimum of 150 s"),
    (["--budget", "six"], "--budget six: not a whole number"),
    (["--out", "{file}"], "is a file"),
    (["--out", "{full}"], "exists and is not empty"),
    (["--out", "{file}/sub"], "cannot be created"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, args: list[str],
                                                         flag: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    out = [a.format(file=tmp_path / "file", full=tmp_path / "full") for a in args]
    if "--out" not in out:
        out += ["--out", str(tmp_path / "new")]
    proc = timeouts.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--dry-run", *out], 60,
                        capture_output=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and flag in proc.stderr
    assert proc.stderr.startswith(f"gpu_check: {out[0]} ")
    assert sorted(tmp_path.rglob("*")) == before


def test_no_cuda_without_dry_run_is_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    proc = _runner(tmp_path, {}, 5, "--out", str(tmp_path / "out"))
    _, err = timeouts.communicate(proc, 60)
    assert proc.returncode == 2
    assert err.startswith("gpu_check: --dry-run not given and no CUDA device")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_budget_by_construction_and_docs_table() -> None:
    share = gpu_check.budgets(gpu_check.DEFAULT_BUDGET_S)
    assert gpu_check.DEFAULT_BUDGET_S <= 360
    assert gpu_check.STARTUP_S + sum(share.values()) <= gpu_check.DEFAULT_BUDGET_S
    assert min(gpu_check.budgets(gpu_check.MIN_BUDGET_S).values()) >= 10
    doc = (ROOT / "docs" / "gpu.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) s \|", doc, re.MULTILINE)
    assert rows == [(p.name, str(share[p.name])) for p in gpu_check.PARTS]
    command = re.search(r"```bash\n(bash scripts/gpu_check\.sh --out \"\$OUT\"\n)```", doc)
    assert command is not None and len(command.group(1)) < 2000


def test_stub_run_writes_four_files_and_a_timeout_kills_the_part_group(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _runner(tmp_path, {"peak": "hang"}, 6, "--dry-run", "--out", str(out))
    stdout, err = timeouts.communicate(proc, 120)
    assert proc.returncode == 1, err  # the timed-out part
    assert "budget 360 s" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [gpu_check.SUMMARY, gpu_check.EVIDENCE, gpu_check.ARCHIVE])
    parts = _parts(out)
    assert list(parts) == [p.name for p in gpu_check.PARTS]
    assert parts["peak"] == "timeout (6 s)"
    assert all(s == "ok" for name, s in parts.items() if name != "peak")
    assert (out / gpu_check.EVIDENCE).read_text().count("row,") == len(gpu_check.PARTS)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)  # leader and grandchild


def test_sigterm_leaves_the_files_written_and_no_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _runner(tmp_path, {"peak": "hang"}, 60, "--dry-run", "--out", str(out))
    pids_file = tmp_path / "pids"
    deadline = time.monotonic() + timeouts.scaled(60)
    while not (pids_file.exists() and pids_file.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the hanging part did not start"
        time.sleep(0.1)
    pids = [int(p) for p in pids_file.read_text().split()]
    proc.send_signal(signal.SIGTERM)
    _, err = timeouts.communicate(proc, 30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not any(_alive(pid) for pid in pids)
    parts = _parts(out)
    assert parts["evidence"] == "ok" and parts["peak"] == f"killed (signal {signal.SIGTERM})"
    assert "gpu_tests" not in parts
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [gpu_check.SUMMARY, gpu_check.EVIDENCE, gpu_check.ARCHIVE])
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no half-written file


def test_environment_rows_say_why_torchtitan_is_skipped() -> None:
    info = {"gpu": None, "python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
            "triton": "3.6.0", "transformers": "5.17.0", "peft": "0.21.2", "numpy": "2.4.6",
            "torchtitan": None, "memfine": "0.2.0 from src", "torchtitan_missing":
            "torchtitan is not installed: pip install 'memfine[torchtitan]'"}
    rows = {r[1]: r for r in gpu_check_csv.environment(info)}
    assert rows["torchtitan"][2].startswith("skipped: torchtitan is not installed")
    assert rows["torch"][4] == "2.11.0+cu130" and rows["gpu"][4] == "none (cpu)"


def test_evidence_skips_cuda_metrics_with_the_reason_on_a_dry_run(tmp_path: Path) -> None:
    import gpu_check_evidence  # torch and memfine: imported here only

    out = tmp_path / "evidence.csv"
    gpu_check_evidence.main([str(out), "--dry-run", "--tokens", "64", "--repeats", "1",
                             "--warmup", "0", "--methods", "fused", "torchtitan_style"])
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    skipped = {r["metric"] for r in rows if r["status"] == "skipped: no CUDA (dry run)"}
    assert skipped == {"kernel_count", "kernel_time_ms", "memcpy_memset_count",
                       "cuda_host_syncs"}
    assert all(r["status"] == "ok" for r in rows if r["metric"] not in skipped
               | {"predicted_peak_bytes"})
