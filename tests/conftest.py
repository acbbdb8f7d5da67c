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


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in TRITON_MARKERS:
        if item.get_closest_marker(name) and (reason := triton_skip_reason(name)):
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small tensors: one intra-op thread (on a busy machine, threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
