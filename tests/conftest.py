"""Shared fixtures: every test starts from a fixed seed; ``one_thread`` on request.

Devices: the default suite (``-m "not gpu and not slow"``) runs on the CPU, also on a CUDA
machine; tests that use CUDA are marked ``gpu``. Triton kernels of the default suite run on CPU
tensors through the Triton interpreter, which Triton chooses once per process when a kernel is
defined, so it is switched on here, before anything is collected, unless the run selects ``gpu``
tests (those launch native kernels on CUDA) or ``TRITON_INTERPRET`` is already set. Tests that
need the interpreter are marked ``triton_cpu`` and skip, with a reason, where it is off.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator

import pytest
import torch

from devices import selects_gpu_tests, triton_skip_reason

TRITON_MARKERS = {"triton_cpu": "runs Triton kernels on CPU tensors (TRITON_INTERPRET=1)",
                  "triton_gpu": "runs native Triton kernels on CUDA tensors"}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in TRITON_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if "TRITON_INTERPRET" not in os.environ and not selects_gpu_tests(config.option.markexpr):
        os.environ["TRITON_INTERPRET"] = "1"


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = exitstatus


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After Ctrl-C (the summary printed, every plugin unconfigured) leave at once: the
    interpreter's final garbage collection over torch's objects takes seconds on a loaded
    machine."""
    if config.stash.get(_EXIT_STATUS, None) == pytest.ExitCode.INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(pytest.ExitCode.INTERRUPTED))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in TRITON_MARKERS:
        if item.get_closest_marker(name) and (reason := triton_skip_reason(name)):
            pytest.skip(reason)


@pytest.fixture(autouse=True, scope="session")
def _stop_signals_reach_pytest() -> Iterator[None]:
    """A training run inside a test (``train(...)``, ``main(["train", ...])``) stopped by Ctrl-C
    saves its checkpoint, then raises the signal again for pytest: the session stops with its
    summary instead of failing one test and carrying on."""
    from memfine.runtime.stop import signals_to_caller

    with signals_to_caller():
        yield


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cuda_memory_unknown(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside ``gpu`` tests CUDA's memory reads as unknown, so a ``"cuda"`` device type on any
    machine resolves the row block of a device of unknown memory (512 MiB), as on the CPU."""
    if request.node.get_closest_marker("gpu") is None:
        import memfine.config.moe as config_moe

        monkeypatch.setattr(config_moe, "_cuda_memory", lambda: None)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small tensors: one intra-op thread (on a busy machine, threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
