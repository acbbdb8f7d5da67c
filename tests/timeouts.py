"""Wall-clock limits of the tests that wait on other processes, scaled for a loaded machine.

No test's outcome depends on how fast the machine is: a limit only stops a run that hangs. Each
limit is a base value (what an idle machine needs, with a wide margin) times a scale: the
environment variable ``MEMFINE_TEST_TIMEOUT_SCALE`` when set (e.g. 4 on a shared CI runner), or
else the 1-minute load average per CPU when the wait starts (at least 1; load 20 on 2 CPUs
gives 10). A limit that expires fails the test with a message naming the base, the scale, where
the scale came from and the variable to raise it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import pytest

SCALE_ENV = "MEMFINE_TEST_TIMEOUT_SCALE"


def timeout_scale() -> tuple[float, str]:
    """(scale, where it came from): ``MEMFINE_TEST_TIMEOUT_SCALE``, else load average / CPUs.

    Raises:
        ValueError: when the variable is set to something other than a number > 0.
    """
    raw = os.environ.get(SCALE_ENV, "").strip()
    if raw:
        try:
            scale = float(raw)
        except ValueError:
            scale = float("nan")
        if not scale > 0:
            raise ValueError(f"{SCALE_ENV} must be a number > 0, got {raw!r}")
        return scale, f"{SCALE_ENV}={raw}"
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1.0, load / cpus), f"load average {load:.1f} on {cpus} CPUs; {SCALE_ENV} unset"


def scaled(base_s: float) -> float:
    """``base_s`` times :func:`timeout_scale`, in seconds."""
    return base_s * timeout_scale()[0]


def expired_message(what: str, base_s: float) -> str:
    """The failure line of a limit that expired: what, the limit and how to raise it."""
    scale, source = timeout_scale()
    return (f"{what} exceeded {base_s * scale:.0f} s (base {base_s:.0f} s x scale {scale:.2f}, "
            f"{source}); on a loaded machine set {SCALE_ENV} higher")


def run(cmd: list[str], base_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, text=True, **kwargs)`` under a scaled limit; fails the test when
    it expires (the command is killed)."""
    try:
        return subprocess.run(cmd, text=True, timeout=scaled(base_s), **kwargs)
    except subprocess.TimeoutExpired:
        pytest.fail(expired_message(" ".join(map(str, cmd)), base_s))


def communicate(proc: subprocess.Popen[str], base_s: float, *,
                group: bool = False) -> tuple[str, str]:
    """``proc.communicate()`` under a scaled limit; on expiry kill it (its whole process group
    with ``group``: it was started with ``start_new_session=True``) and fail the test with the
    end of its output."""
    try:
        return proc.communicate(timeout=scaled(base_s))
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        out, err = proc.communicate()
        tail = ((out or "") + (err or ""))[-4000:]
        pytest.fail(f"{expired_message(' '.join(map(str, proc.args)), base_s)}:\n{tail}")
