"""Which device a test runs on: the one rule every test module follows.

The default suite runs on the CPU, on any machine; a test that needs CUDA is marked ``gpu`` and
skipped without a CUDA device (``gpu`` below). Triton kernels of the default suite run on CPU
tensors through the Triton interpreter; the root conftest turns it on for runs that select no
``gpu`` test (Triton chooses interpreted or native kernels once per process). Tests marked
``triton_cpu`` need the interpreter and ``triton_gpu`` native kernels; the conftest skips each,
with a reason, when its process has the other kind (checked when the test starts, after the
conftest has chosen).
"""

from __future__ import annotations

import os

import pytest
import torch
from _pytest.mark.expression import Expression

from memfine._optional import is_available


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a ``-m`` expression selects tests marked ``gpu`` (an empty one selects all)."""
    if not markexpr.strip():
        return True
    return bool(Expression.compile(markexpr).evaluate(lambda name: name == "gpu"))


def triton_interpreter() -> bool:
    """Whether this process runs Triton kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_skip_reason(marker: str) -> str | None:
    """Why a test marked ``triton_cpu`` or ``triton_gpu`` cannot run here, or None if it can."""
    if not is_available("triton"):
        return "needs triton (pip install 'memfine[triton]')"
    if marker == "triton_cpu" and not triton_interpreter():
        return ("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (the conftest sets it "
                "unless the run selects gpu tests)")
    if marker == "triton_gpu" and triton_interpreter():
        return "native Triton kernels need TRITON_INTERPRET unset (run -m gpu on its own)"
    return None


gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
"""Marks of a test that runs on CUDA: ``gpu`` and a skip without a CUDA device."""

triton_cpu = pytest.mark.triton_cpu
"""Mark of a test that runs Triton kernels on CPU tensors (the interpreter)."""

triton_gpu = [*gpu, pytest.mark.triton_gpu]
"""Marks of a test that runs native Triton kernels on CUDA tensors."""
