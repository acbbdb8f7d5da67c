"""Shared fixtures: every test starts from a fixed seed; ``one_thread`` on request."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch


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
