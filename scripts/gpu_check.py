"""memfine on one CUDA GPU within one budget, every result in at most four files under --out.

    scripts/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS]

Runs with the python that runs it (no install, no network); memfine is imported from this
tree's src/ (first on PYTHONPATH), installed or not. Start-up (a probe of the python:
torch, CUDA, the GPU, triton, transformers, torchtitan) gets :data:`STARTUP_S`; the parts share
the rest of the budget by :data:`PARTS`' weights, so the whole run takes at most the budget by
construction (printed at the start). Each part runs in its own process group (its own session)
under its budget: past it the whole group is killed. SIGTERM, SIGINT or SIGHUP kill the running
part's group, record what was written and exit. The parts, cheapest and most decisive first:
``evidence`` (scripts/gpu_check_evidence.py without Triton), ``evidence_triton`` (the Triton
backend: its kernels compile on first launch), ``peak`` (scripts/gpu_check_peak.py),
``gpu_tests`` (pytest -m gpu), ``train`` (memfine train --device cuda), ``compile`` (the same with
--compile, last). ``--dry-run`` runs them on the CPU at tiny shapes.

Files under --out (written as each part ends; a kill leaves those written so far):
``gpu_check.csv`` (part, name, status, metric, value, unit, detail: the environment, every
part's status and wall time, per-test and per-run rows), ``evidence.csv``, ``cuda_peak.csv`` and
``gpu_check_logs.tar.gz`` (each part's log, the JUnit XML, the runs' JSON). A status is ``ok``,
``skipped: <reason>``, ``failed (rc N)``, ``timeout (N s)`` or ``killed (signal N)``.
Bad input (an --out that exists and is not empty, is a file or is not writable; a budget below
:data:`MIN_BUDGET_S`; no CUDA without --dry-run): one line naming the flag and value, exit 2,
nothing written. Standard library only: it runs before anything is known about the python.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gpu_check_csv as rows_of

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 360
MIN_BUDGET_S = 150
STARTUP_S = 30
"""The probe's timeout plus the runner's own work (archive, CSV rows)."""
GRACE_S = 3
"""A part's budget includes this much between SIGTERM and SIGKILL of its group."""
SUMMARY, EVIDENCE, PEAK, ARCHIVE = ("gpu_check.csv", "evidence.csv", "cuda_peak.csv",
                                    "gpu_check_logs.tar.gz")
ARCHIVED = (".log", ".xml", ".json", ".jsonl", ".txt", ".toml", ".csv")
MAX_ARCHIVED_BYTES = 2 * 2**20


@dataclass(frozen=True)
class Part:
    """One part: its weight in the budget, what it does, the variables its dry run sets."""

    name: str
    weight: int
    what: str
    env: dict[str, str] = field(default_factory=dict)


PARTS = (
    Part("evidence", 80, "fused, fused_512mib, torchtitan_style, hf_grouped_mm at the "
         "Qwen3-30B-A3B layer, bf16, T 4096 and 16384"),
    Part("evidence_triton", 75, "the Triton backend at the same layer (autotuned kernels "
         "compile on the first call)", {"TRITON_INTERPRET": "1"}),
    Part("peak", 30, "measured against predicted peak per case"),
    Part("gpu_tests", 65, "pytest -m gpu (native Triton kernels: TRITON_INTERPRET unset)"),
    Part("train", 30, "memfine train, preset small (dry run: tiny)"),
    Part("compile", 50, "the same with --compile"),
)


def budgets(total_s: int) -> dict[str, int]:
    """Each part's seconds: its weight's share of ``total_s`` minus start-up (rounded down)."""
    rest, weights = total_s - STARTUP_S, sum(p.weight for p in PARTS)
    return {p.name: rest * p.weight // weights for p in PARTS}


def commands(dry: bool, work: Path, py: str) -> dict[str, list[str]]:
    """Each part's command line; results go under ``work`` (the runner copies them to --out).

    The dry run's ``compile`` runs under ``TORCHDYNAMO_DISABLE=1`` (the flags and the files
    only: inductor on the CPU takes minutes); its ``gpu_tests`` collect the gpu tests (they skip
    without CUDA) and run the plugin tests that fake a CUDA device.
    """
    s = str(ROOT / "scripts")
    ev = [py, f"{s}/gpu_check_evidence.py", str(work / EVIDENCE)]
    peak = [py, f"{s}/gpu_check_peak.py", str(work / PEAK), str(work / "peak_rows.csv"),
            "--device", "cpu" if dry else "cuda"]
    tests = [py, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-m", "gpu", "-o",
             "addopts=", "--junitxml", str(work / "gpu_tests.xml"), "tests/gpu"]
    train = [py, "-m", "memfine", "train", "--device", "cpu" if dry else "cuda", "--no-progress",
             "--sample-tokens", "0", "--overwrite", "--log-every", "1"]
    if dry:
        train += ["--preset", "tiny", "--data", "tests/assets/pydoc_topics_sample.txt"]
        return {"evidence": [*ev, "--dry-run", "--methods", "fused", "fused_512mib",
                             "torchtitan_style", "hf_grouped_mm"],
                "evidence_triton": [*ev, "--dry-run", "--methods", "fused", "triton",
                                    "--tokens", "16", "--repeats", "1", "--warmup", "0"],
                "peak": [*peak, "--tiny"], "gpu_tests": [*tests, "tests/test_devices.py", "-k",
                                                         "not suite_passes"],
                "train": [*train, "--max-steps", "2", "--eval-every", "2", "--out",
                          str(work / "train")],
                "compile": ["env", "TORCHDYNAMO_DISABLE=1", *train, "--compile", "--max-steps",
                            "1", "--eval-every", "1", "--out", str(work / "train_compile")]}
    train += ["--preset", "small"]
    return {"evidence": [*ev, "--methods", "fused", "fused_512mib", "torchtitan_style",
                         "hf_grouped_mm"],
            "evidence_triton": [*ev, "--methods", "fused", "triton"],
            "peak": peak, "gpu_tests": [*tests, "tests/measure/test_peak.py", "-k",
                                        "not compiled and not evidence"],
            "train": [*train, "--max-steps", "50", "--eval-every", "50", "--out",
                      str(work / "train")],
            "compile": [*train, "--compile", "--max-steps", "20", "--eval-every", "20", "--out",
                        str(work / "train_compile")]}


class Usage(Exception):
    """A bad flag value: one line, exit 2."""


def check_out(out: Path) -> None:
    """--out must be absent (its parent writable) or an empty writable directory.

    Raises:
        Usage: naming --out, the path and why.
    """
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise Usage(f"--out {out}: is a file, expected a directory (absent or empty)")
    if out.is_dir():
        if any(out.iterdir()):
            raise Usage(f"--out {out}: exists and is not empty (give a new or empty directory)")
        if not os.access(out, os.W_OK | os.X_OK):
            raise Usage(f"--out {out}: not writable")
        return
    parent = next(p for p in out.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise Usage(f"--out {out}: cannot be created ({parent} is not a writable directory)")


PROBE = """
import json, sys
info = {"python": sys.version.split()[0]}
try:
    import torch
except ImportError as err:
    print(json.dumps({**info, "torch": None, "error": str(err)})); raise SystemExit
cuda = torch.cuda.is_available()
info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda=cuda,
            gpu=torch.cuda.get_device_name(0) if cuda else None)
from importlib.metadata import PackageNotFoundError, version
for name in ("triton", "transformers", "peft", "numpy", "torchtitan"):
    try:
        info[name] = version(name)
    except PackageNotFoundError:
        info[name] = None
try:
    import memfine
    info["memfine"] = memfine.__version__ + " from " + memfine.__file__
    from memfine.baselines.titan_style import torchtitan_missing
    info["torchtitan_missing"] = torchtitan_missing()
except Exception as err:
    info["memfine_error"] = f"{type(err).__name__}: {err}"
print(json.dumps(info))
"""


def probe(py: str, env: dict[str, str]) -> dict[str, object]:
    """What the python has (PROBE's JSON); ``error`` when it could not say in time."""
    try:
        proc = subprocess.run([py, "-c", PROBE], capture_output=True, text=True, env=env,
                              timeout=STARTUP_S - 5, cwd=ROOT, check=False)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as err:
        return {"torch": None, "error": f"probe failed: {type(err).__name__}"}


def child_env(dry: bool) -> dict[str, str]:
    """The parts' environment: this tree's src/ first on PYTHONPATH (the tree is what is checked,
    installed or not)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if dry:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _die_with_parent() -> None:  # pragma: no cover (runs in the child)
    """The part's leader gets SIGKILL when the runner dies (Linux; best effort)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the part's process group, SIGKILL it after ``grace_s``, reap the leader."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            continue
        break
    proc.poll()


class Runner:
    """Runs the parts and keeps the files under --out current after each one."""

    def __init__(self, out: Path, work: Path, env: dict[str, str]) -> None:
        self.out, self.work, self.env = out, work, env
        self.current: subprocess.Popen[bytes] | None = None
        self.current_name = ""
        self.current_start = 0.0
        self.failed = False

    def rows(self, rows: list[list[object]]) -> None:
        """Append rows to the summary CSV (header first), flushed to disk."""
        path = self.out / SUMMARY
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(rows_of.COLUMNS)
            writer.writerows(rows)
            f.flush()
            os.fsync(f.fileno())

    def publish(self) -> None:
        """Copy the evidence and peak CSVs to --out and rewrite the archive (each atomically)."""
        for name in (EVIDENCE, PEAK):
            if (self.work / name).exists():
                shutil.copyfile(self.work / name, self.out / f".{name}.tmp")
                os.replace(self.out / f".{name}.tmp", self.out / name)
        tmp = self.out / f".{ARCHIVE}.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(self.work.rglob("*")):
                if (path.is_file() and path.suffix in ARCHIVED and path.name not in (EVIDENCE, PEAK)
                        and path.stat().st_size <= MAX_ARCHIVED_BYTES):
                    tar.add(path, arcname=str(path.relative_to(self.work)))
        os.replace(tmp, self.out / ARCHIVE)

    def harvest(self, name: str, status: str, seconds: float) -> None:
        """The part's row, the rows its files give, then :meth:`publish`."""
        rows: list[list[object]] = [[name, name, status, "wall_time", f"{seconds:.1f}", "s", ""]]
        if name == "peak" and (self.work / "peak_rows.csv").exists():
            with (self.work / "peak_rows.csv").open(newline="") as f:
                rows += list(csv.reader(f))
        elif name == "gpu_tests":
            rows += rows_of.junit(self.work / "gpu_tests.xml")
        elif name in ("train", "compile"):
            rows += rows_of.train(name, self.work / ("train" if name == "train" else
                                                     "train_compile"))
        self.rows(rows)
        self.publish()

    def run(self, name: str, argv: list[str], limit_s: float, env: dict[str, str]) -> str:
        """Run one part in its own session under ``limit_s``; its status."""
        start = time.monotonic()
        with (self.work / f"{name}.log").open("wb") as log:
            self.current = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True,
                                            preexec_fn=_die_with_parent)
            self.current_name, self.current_start = name, start
            try:
                rc = self.current.wait(timeout=max(1.0, limit_s - GRACE_S))
                status = "ok" if rc == 0 else (
                    "skipped: no test selected" if name == "gpu_tests" and rc == 5
                    else f"failed (rc {rc})")
            except subprocess.TimeoutExpired:
                status = f"timeout ({limit_s:.0f} s)"
            kill_group(self.current, GRACE_S)  # also what a finished part left behind
            self.current = None
        if status != "ok" and not status.startswith("skipped"):
            self.failed = True
            tail = (self.work / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
            print("\n".join("   | " + line for line in tail))
        self.harvest(name, status, time.monotonic() - start)
        return status

    def on_signal(self, signum: int, _frame: object) -> None:
        """Kill the running part's group, record it, publish, exit 128 + signum."""
        signal.signal(signum, signal.SIG_IGN)
        if self.current is not None:
            kill_group(self.current, 0.5)
            self.harvest(self.current_name, f"killed (signal {signum})",
                         time.monotonic() - self.current_start)
        for tmp in self.out.glob(".*.tmp"):
            tmp.unlink()
        shutil.rmtree(self.work, ignore_errors=True)
        print(f"gpu_check: stopped by signal {signum}; results in {self.out}", flush=True)
        os._exit(128 + signum)


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags; a bad value is one line on stderr and exit 2 (:class:`Usage`)."""
    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU, tiny")
    parser.add_argument("--out", default="gpu_check", help="results (absent or empty directory)")
    parser.add_argument("--budget", default=str(DEFAULT_BUDGET_S), help="seconds in all "
                        f"(default {DEFAULT_BUDGET_S}, at least {MIN_BUDGET_S})")
    parser.error = lambda message: (_ for _ in ()).throw(Usage(message))  # type: ignore
    args = parser.parse_args(argv)
    try:
        args.budget = int(args.budget)
    except ValueError:
        raise Usage(f"--budget {args.budget}: not a whole number of seconds") from None
    if args.budget < MIN_BUDGET_S:
        raise Usage(f"--budget {args.budget}: below the minimum of {MIN_BUDGET_S} s")
    args.out = Path(os.environ.get("GPU_CHECK_CALLER_DIR", os.getcwd()), args.out).absolute()
    check_out(args.out)
    return args


def main(argv: list[str]) -> int:
    started = time.monotonic()
    try:
        args = parse(argv)
        env = child_env(args.dry_run)
        info = probe(sys.executable, env)
        if not args.dry_run and not info.get("cuda"):
            raise Usage(f"--dry-run not given and no CUDA device: torch {info.get('torch')} "
                        f"says torch.cuda.is_available() is False ({info.get('error', 'no GPU')}"
                        "); run with --dry-run for the CPU check")
    except Usage as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    share = budgets(args.budget)
    print(f"gpu_check: budget {args.budget} s = start-up {STARTUP_S} s + "
          + ", ".join(f"{p.name} {share[p.name]} s" for p in PARTS)
          + f"; results in {args.out}"
          + ("\n(dry run: every part on the CPU at tiny shapes)" if args.dry_run else ""),
          flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    runner = Runner(args.out, work, env)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, runner.on_signal)
    (work / "environment.json").write_text(json.dumps(info, indent=1))
    runner.rows(rows_of.environment(info))
    runner.publish()
    deadline = started + args.budget
    cmds = commands(args.dry_run, work, sys.executable)
    for part in PARTS:
        left = deadline - time.monotonic() - 2  # the last publish
        limit = min(share[part.name], left)
        print(f"== {part.name} ({limit:.0f} s): {part.what}", flush=True)
        if limit < 5:
            status = "skipped: the overall budget is spent"
            runner.harvest(part.name, status, 0.0)
        else:
            part_env = dict(env, **(part.env if args.dry_run else {}))
            if part.name == "gpu_tests" or not args.dry_run:  # native Triton kernels on CUDA
                part_env.pop("TRITON_INTERPRET", None)
            status = runner.run(part.name, cmds[part.name], limit, part_env)
        print(f"   {status}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_check: {time.monotonic() - started:.0f} s; results in {args.out}: {SUMMARY} "
          f"(every part's status), {EVIDENCE}, {PEAK}, {ARCHIVE} (logs, JUnit XML, runs' JSON)")
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
