"""Which device a test runs on: the one rule every test module follows.

The default suite runs on the CPU, on any machine; a test that needs CUDA is marked ``gpu`` and
skipped without a CUDA device (``gpu`` below). Triton kernels of the default suite run on CPU
tensors through the Triton interpreter; the root conftest turns it on for runs that select no
``gpu`` test (Triton chooses interpreted or native kernels once per process), and tests that
need it are marked ``triton_cpu`` below, so they skip, with a reason, in a native-Triton run.
"""

from __future__ import annotations

import os

import pytest
import torch

from memfine._optional import is_available


def triton_interpreter() -> bool:
    """Whether this process runs Triton kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_cpu_reason() -> str | None:
    """Why Triton kernels cannot run on CPU tensors in this process, or None if they can."""
    if not is_available("triton"):
        return "needs triton (pip install 'memfine[triton]')"
    if not triton_interpreter():
        return ("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (the conftest sets it "
                "unless the run selects gpu tests)")
    return None


def _cuda_skip() -> pytest.MarkDecorator:
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _triton_cpu_skip() -> pytest.MarkDecorator:
    reason = triton_cpu_reason()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def _triton_gpu_skip() -> pytest.MarkDecorator:
    reason = None
    if not is_available("triton"):
        reason = "needs triton (pip install 'memfine[triton]')"
    elif triton_interpreter():
        reason = "native Triton kernels need TRITON_INTERPRET unset (run with -m gpu)"
    return pytest.mark.skipif(reason is not None, reason=reason or "")


gpu = [pytest.mark.gpu, _cuda_skip()]
"""Marks of a test that runs on CUDA: ``gpu`` and a skip without a CUDA device."""

triton_cpu = _triton_cpu_skip()
"""Skip mark of a test that runs Triton kernels on CPU tensors (the interpreter)."""

triton_gpu = [*gpu, _triton_gpu_skip()]
"""Marks of a test that runs native Triton kernels on CUDA tensors."""
