"""tests/ops: without a GPU, Triton kernels run on CPU through the Triton interpreter.

The interpreter is chosen when a kernel is first defined, so the variable is set here, before any
test module launches a kernel. An explicit TRITON_INTERPRET in the environment is respected.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
