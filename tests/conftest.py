"""Shared fixtures: every test starts from a fixed seed; ``one_thread`` on request."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

# Triton picks its interpreter from this variable when it is first imported or a kernel is first
# defined; torch.compile tests import torch._dynamo (and with it triton) while pytest collects,
# before tests/ops/conftest.py runs, so the CPU interpreter is chosen here, at the root.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
