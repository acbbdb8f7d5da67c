"""The one tolerance table of the test suite: dtype → (atol, rtol) for forward values and grads.

No other test file contains a literal tolerance. A loosened entry says why and the measured error.
"""

from __future__ import annotations

import torch

FORWARD: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-4),
    # bf16 has an 8-bit mantissa: one rounding of a unit-scale value is up to 2^-8 ≈ 4e-3.
    torch.bfloat16: (2e-2, 2e-2),
}
GRAD: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-3),
    torch.bfloat16: (5e-2, 5e-2),
}
# Chunked vs unchunked in fp32 (MemFine issue bar): values within 1e-6; weight gradients summed
# chunk by chunk accumulate in another order, so they use the fp32 GRAD row.
CHUNKED_ATOL = 1e-6
# Losses of two training runs that must agree (chunked vs unchunked, resumed vs straight).
LOSS_ATOL = 1e-4
# A distributed run (any mesh layout, resumed across layouts, or accumulated micro-batches) vs
# one process on the same global batches (scale-out bar): per-step losses, aux losses and grad
# norms within 1e-5; every parameter after 20 steps within 1e-4.
DISTRIBUTED_LOSS_ATOL = 1e-5
DISTRIBUTED_PARAM_ATOL = 1e-4
# One rank's sharded model vs the same model unsharded (the same arithmetic, through DTensor):
# the loss within 1e-6 relative; adapter gradients within 1e-5 relative, 1e-7 absolute.
SHARDED_LOSS_RTOL = 1e-6
SHARDED_GRAD_RTOL, SHARDED_GRAD_ATOL = 1e-5, 1e-7
# Memory model vs measurement (issue bar): predicted peak bytes within 3% of the measured peak
# (measured on the validation grid: peak and saved bytes both exact on the CPU).
PEAK_RTOL = 0.03
# The whole training step's memory model vs torch.profiler (embedding, attention, norms, MoE
# layers, logits, loss): within 3% (the attention weight gradients are modelled live at the peak).
STEP_PEAK_RTOL = 0.03


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, grad: bool = False,
                 dtype: torch.dtype | None = None, msg: str = "") -> None:
    """torch.testing.assert_close with the table's tolerance for ``dtype`` (default: actual's)."""
    table = GRAD if grad else FORWARD
    atol, rtol = table[dtype or actual.dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol,
                               msg=lambda m: f"{msg}: {m}" if msg else m)


def assert_chunked_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Chunked vs unchunked (fp32): within CHUNKED_ATOL, absolute and relative.

    The grouped GEMMs of a chunk have fewer rows, and the CPU kernels block the reduction
    differently for different row counts, so per-row results differ by a few ulps (measured
    worst: 1.9e-6 on a routing-weight gradient of 5.5, i.e. 3.5e-7 relative). Expert weight
    gradients (``name`` mentions ``w_up`` or ``w_down``) are sums of per-chunk partial sums whose
    rounding scales with the tensor's largest entry, so their absolute bound is CHUNKED_ATOL times
    that (measured worst: 1.09e-6 on an entry of 0.058 with c=8).
    """
    atol = CHUNKED_ATOL
    if ("w_up" in name or "w_down" in name) and expected.numel():
        atol *= max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=CHUNKED_ATOL,
                               msg=lambda m: f"{name}: {m}")
# CUDA peak (max_memory_allocated after a reset) vs the memory model: the caching allocator
# rounds every block up to 512 bytes (small tensors: the index arrays, the aux losses) and
# cuBLAS/cuBLASLt may allocate workspaces through it; 10% or 4 MiB, whichever is larger, holds
# both at the sizes the gpu tests use (not yet measured on a GPU: tighten from the first run).
CUDA_PEAK_RTOL = 0.10
CUDA_PEAK_ATOL_BYTES = 4 << 20
