"""Where and with what a result was produced: device, CPU, threads, versions, commit, time.

Benchmark CSVs (:mod:`memfine.bench.results`, one column per field) and the training results of
``scripts/training_results.py`` record the :class:`Environment` of :func:`collect_environment`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Environment:
    """Where and with what a result was produced (the benchmark CSVs' environment columns).

    Attributes:
        device: ``cpu`` or ``cuda:<i> (<GPU name>)``.
        cpu_model: the CPU's model name.
        threads: torch intra-op threads.
        torch_version: ``torch.__version__``.
        triton_version: installed triton version, or ``not installed``.
        memfine_version: installed memfine version.
        git_sha: short commit of the memfine checkout (``-dirty`` with local changes), or
            ``unknown`` outside a git checkout.
        utc_timestamp: ISO 8601 UTC time, seconds.
    """

    device: str
    cpu_model: str
    threads: int
    torch_version: str
    triton_version: str
    memfine_version: str
    git_sha: str
    utc_timestamp: str

    def line(self) -> str:
        """One human line: device, CPU, threads, versions, commit, date."""
        threads = f"{self.threads} thread" + ("s" if self.threads != 1 else "")
        return (f"{self.device}; CPU {self.cpu_model}; {threads}; torch "
                f"{self.torch_version}; triton {self.triton_version}; memfine "
                f"{self.memfine_version} ({self.git_sha}); {self.utc_timestamp}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _version(package: str) -> str:
    if importlib.util.find_spec(package) is None:
        return "not installed"
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _git_sha() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, text=True,
                             capture_output=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, check=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def collect_environment(device: str | torch.device = "cpu") -> Environment:
    """Describe this process's environment (no tensors are allocated)."""
    dev = torch.device(device)
    name = str(dev)
    if dev.type == "cuda":
        name = f"{dev} ({torch.cuda.get_device_name(dev)})"
    return Environment(
        device=name, cpu_model=_cpu_model(), threads=torch.get_num_threads(),
        torch_version=torch.__version__, triton_version=_version("triton"),
        memfine_version=_version("memfine"), git_sha=_git_sha(),
        utc_timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
