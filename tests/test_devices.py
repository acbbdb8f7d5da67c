"""The default suite runs on the CPU also where CUDA is present; gpu tests are the only CUDA ones.

The fake-CUDA plugin (``tests/plugins/fake_cuda.py``) makes ``torch.cuda.is_available()`` True
and unsets ``TRITON_INTERPRET`` before the suite is imported, as on a CUDA machine. Under it,
every test module is collected (import-time device choices, skip marks), and the tests about
devices, CUDA and Triton run: a module that put a default-suite tensor on ``cuda``, or launched
Triton on CPU tensors without the interpreter, fails there, since tensors stay on the CPU.
The whole default suite under the plugin is the ``slow`` test below.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import timeouts
from devices import selects_gpu_tests

ROOT = Path(__file__).resolve().parents[1]
DEVICE_TESTS = "triton or cuda or gpu or device"


@pytest.mark.parametrize(("markexpr", "selects"), [
    ("not gpu and not slow", False), ("slow", False), ("gpu", True), ("gpu and not slow", True),
    ("", True), ("not slow", True)])
def test_selects_gpu_tests(markexpr: str, selects: bool) -> None:
    assert selects_gpu_tests(markexpr) is selects


def _pytest_under_fake_cuda(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return timeouts.run(
        [sys.executable, "-m", "pytest", "-p", "plugins.fake_cuda", "-p", "no:cacheprovider",
         "-m", "not gpu and not slow", "-rs", "--ignore", str(Path(__file__)), *args],
        timeout, cwd=ROOT, env=env, capture_output=True)


def _check(done: subprocess.CompletedProcess[str]) -> None:
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "fake CUDA: torch.cuda.is_available() -> True" in out
    assert " passed" in out and " failed" not in out and " error" not in out
    assert "Triton kernels on CPU tensors need" not in out, "Triton tests skipped: no interpreter"


def test_device_tests_of_every_module_pass_under_cuda() -> None:
    _check(_pytest_under_fake_cuda("tests", "-k", DEVICE_TESTS, timeout=900))


@pytest.mark.slow
def test_default_suite_passes_under_cuda() -> None:
    _check(_pytest_under_fake_cuda("tests", "-x", timeout=1800))
