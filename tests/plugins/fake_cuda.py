"""pytest plugin: run the CPU suite as it would start on a CUDA machine.

``pytest -p plugins.fake_cuda ...`` (with ``tests`` on the path) makes
``torch.cuda.is_available()`` return True and removes ``TRITON_INTERPRET`` from the environment
before any conftest or test module is imported, so every import-time device choice
(``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"``, skip marks, the conftests' Triton
interpreter switch) takes the branch a CUDA machine takes. Tensors still live on the CPU: a test
that puts a tensor on ``cuda`` fails here, which is what the device-selection check looks for.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

# bitsandbytes (imported by peft and by the 4-bit experts) loads its CUDA backend when CUDA is
# available and reads torch's CUDA stream function at import, which a CPU build lacks: a stand-in
# lets it import (its CUDA kernels are never called; tensors stay on the CPU).
if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
    torch._C._cuda_getCurrentRawStream = lambda *_: 0  # type: ignore[attr-defined]

os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True  # type: ignore[assignment]
torch.cuda.device_count = lambda: 1  # type: ignore[assignment]

# torch.distributed.checkpoint's file writer overlaps its copies on a CUDA stream whenever CUDA
# is available; the tensors here are on the CPU and there is no stream, so it copies serially.
_dcp_fs = importlib.import_module("torch.distributed.checkpoint.filesystem")
_dcp_fs._OverlappingCpuLoader = (  # type: ignore[attr-defined]
    lambda resolve_fun, **_: _dcp_fs._SerialCpuLoader(resolve_fun))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line("fake CUDA: torch.cuda.is_available() -> True, "
                                "TRITON_INTERPRET unset at start")
