"""Shared fixtures: every test starts from a fixed seed; ``one_thread`` on request.

Devices: the default suite (``-m "not gpu and not slow"``) runs on the CPU, also on a CUDA
machine; tests that use CUDA are marked ``gpu``. Triton kernels of the default suite run on CPU
tensors through the Triton interpreter, which Triton chooses once per process when a kernel is
defined, so it is switched on here, before anything is collected, unless the run selects ``gpu``
tests (those launch native kernels on CUDA) or ``TRITON_INTERPRET`` is already set. Tests that
need the interpreter skip, with a reason, where it is off (:func:`triton_interpreter`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch
from _pytest.mark.expression import Expression


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a ``-m`` expression selects tests marked ``gpu`` (an empty one selects all)."""
    if not markexpr.strip():
        return True
    return bool(Expression.compile(markexpr).evaluate(lambda name: name == "gpu"))


def triton_interpreter() -> bool:
    """Whether Triton kernels of this run execute on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config: pytest.Config) -> None:
    if "TRITON_INTERPRET" not in os.environ and not selects_gpu_tests(config.option.markexpr):
        os.environ["TRITON_INTERPRET"] = "1"


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
