"""Bitwise repeatable runs: torch's deterministic algorithms and a fixed cuBLAS workspace.

On CUDA, some kernels (atomic adds in scatter and index_add_, split-K GEMM reductions) sum in a
different order from run to run. ``torch.use_deterministic_algorithms(True)`` picks
deterministic kernels or raises where none exists, and cuBLAS needs
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set before its first handle is created) for repeatable
GEMMs. The fused experts' backward sums each token's k rows in a fixed order, so memfine's own
path has no atomics. Reference: PyTorch "Reproducibility" notes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True) -> Iterator[None]:
    """Run the block with deterministic algorithms (``enabled``), then restore the old settings.

    Args:
        enabled: False runs the block unchanged.

    Side effects (inside the block): ``torch.use_deterministic_algorithms(True)``,
    ``torch.backends.cudnn.benchmark = False`` and, unless already set,
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in this process's environment. A cuBLAS handle created
    before the block keeps its workspace: enter it before the first CUDA matmul.
    """
    if not enabled:
        yield
        return
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    set_workspace = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    if set_workspace:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if set_workspace:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
