"""tests/timeouts.py: the limits of waits on other processes scale, and say how when they expire."""

from __future__ import annotations

import subprocess
import sys

import pytest

import timeouts


def test_the_variable_sets_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(timeouts.SCALE_ENV, "2.5")
    assert timeouts.timeout_scale() == (2.5, "MEMFINE_TEST_TIMEOUT_SCALE=2.5")
    assert timeouts.scaled(40) == 100.0


def test_without_the_variable_the_load_per_cpu_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timeouts.SCALE_ENV, raising=False)
    monkeypatch.setattr(timeouts.os, "getloadavg", lambda: (20.0, 0.0, 0.0))
    monkeypatch.setattr(timeouts.os, "cpu_count", lambda: 2)
    assert timeouts.timeout_scale() == (10.0, "load average 20.0 on 2 CPUs; "
                                              "MEMFINE_TEST_TIMEOUT_SCALE unset")
    monkeypatch.setattr(timeouts.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert timeouts.timeout_scale()[0] == 1.0  # never below the base


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "nan"])
def test_a_bad_variable_is_one_error_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(timeouts.SCALE_ENV, raw)
    with pytest.raises(ValueError, match=f"MEMFINE_TEST_TIMEOUT_SCALE must be a number > 0, "
                                         f"got '{raw}'"):
        timeouts.timeout_scale()


def test_an_expired_limit_fails_naming_base_scale_and_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(timeouts.SCALE_ENV, "0.01")
    cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(pytest.fail.Exception) as failed:
        timeouts.run(cmd, 100, capture_output=True)
    assert "exceeded 1 s (base 100 s x scale 0.01, MEMFINE_TEST_TIMEOUT_SCALE=0.01); on a " \
           "loaded machine set MEMFINE_TEST_TIMEOUT_SCALE higher" in str(failed.value)
    proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with pytest.raises(pytest.fail.Exception, match="base 100 s x scale 0.01"):
        timeouts.communicate(proc, 100)
    assert proc.returncode is not None  # killed, not left running
