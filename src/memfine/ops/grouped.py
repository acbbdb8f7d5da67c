"""Grouped GEMM backends over expert-grouped rows, behind one signature.

Legend: S routed rows, E experts, I input features, O output features.
Rows of expert e are [offsets[e], offsets[e+1]). Backends:
- ``grouped_mm``: ``torch._grouped_mm`` (fp32/bf16; every inner dimension × itemsize a multiple of
  16 bytes; int32 offsets). Empty groups give exactly zero weight gradients.
- ``loop``: one matmul per expert; any dtype (float64 references), any size.
- ``triton``: optional GPU kernels (``memfine[triton]``), loaded only when chosen.
``auto`` picks ``grouped_mm`` when its rules hold, else ``loop``.
Reference: DESIGN.md §8 (grouped_mm rules measured on CPU).
"""

from __future__ import annotations

import torch

BACKENDS = ("auto", "grouped_mm", "loop", "triton")
_GMM_DTYPES = (torch.float32, torch.bfloat16)


def _aligned(*tensors_and_dims: tuple[torch.Tensor, int]) -> bool:
    return all(dim * t.element_size() % 16 == 0 for t, dim in tensors_and_dims)


def grouped_mm_supported(x_SI: torch.Tensor, w_EIO: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm`` accepts these operands (dtype, alignment, device)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x_SI.dtype not in _GMM_DTYPES or w_EIO.dtype != x_SI.dtype:
        return False
    if x_SI.device.type not in ("cpu", "cuda"):
        return False
    return _aligned((x_SI, x_SI.shape[-1]), (w_EIO, w_EIO.shape[-1]))


def resolve_backend(backend: str, x_SI: torch.Tensor, w_EIO: torch.Tensor) -> str:
    """Return the concrete backend for these operands.

    Raises:
        ValueError: for an unknown backend name, or ``grouped_mm`` forced on operands it rejects.
    """
    if backend not in BACKENDS:
        raise ValueError(f"gemm backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "grouped_mm" if grouped_mm_supported(x_SI, w_EIO) else "loop"
    if backend == "grouped_mm" and not grouped_mm_supported(x_SI, w_EIO):
        raise ValueError(
            "gemm backend 'grouped_mm' needs fp32/bf16 operands whose feature sizes × itemsize "
            f"are multiples of 16 bytes; got x {tuple(x_SI.shape)} {x_SI.dtype}, "
            f"w {tuple(w_EIO.shape)} {w_EIO.dtype}; use 'auto' or 'loop'")
    return backend


def _bounds(offsets_E1: torch.Tensor) -> list[int]:
    return [int(v) for v in offsets_E1.tolist()]


def grouped_mm(x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor,
               backend: str = "auto") -> torch.Tensor:
    """Y[rows of e] = X[rows of e] · W[e] for every expert e.

    Args:
        x_SI: (S, I) rows grouped by expert, float.
        w_EIO: (E, I, O) per-expert weights (any strides; transposed views are fine).
        offsets_E1: (E + 1,) int32 expert_token_offsets, offsets[E] == S.
        backend: ``auto``, ``grouped_mm``, ``loop`` or ``triton``.

    Returns:
        (S, O) new tensor in x's dtype.

    Raises:
        ValueError: for an unknown or unusable backend.
    """
    backend = resolve_backend(backend, x_SI, w_EIO)
    if backend == "grouped_mm":
        return torch._grouped_mm(x_SI.contiguous(), w_EIO, offs=offsets_E1[1:].int())
    if backend == "triton":
        from memfine.ops.triton import grouped_mm as triton_grouped_mm

        return triton_grouped_mm(x_SI, w_EIO, offsets_E1)
    out_SO = x_SI.new_empty(x_SI.shape[0], w_EIO.shape[-1])
    bounds = _bounds(offsets_E1)
    for e in range(w_EIO.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(x_SI[lo:hi], w_EIO[e], out=out_SO[lo:hi])
    return out_SO


def grouped_weight_grad(x_SI: torch.Tensor, grad_y_SO: torch.Tensor, offsets_E1: torch.Tensor,
                        num_experts: int, backend: str = "auto") -> torch.Tensor:
    """dW[e] = X[rows of e]ᵀ · dY[rows of e]; experts with no rows get exact zeros.

    Args:
        x_SI: (S, I) grouped input rows.
        grad_y_SO: (S, O) gradient of the grouped output.
        offsets_E1: (E + 1,) int32 offsets.
        num_experts: E.
        backend: as in :func:`grouped_mm`.

    Returns:
        (E, I, O) new tensor, zero for empty experts.
    """
    w_like = x_SI.new_empty(1, 1, grad_y_SO.shape[-1])
    backend = resolve_backend(backend, grad_y_SO, w_like) if backend != "triton" else "loop"
    if backend == "grouped_mm" and _aligned((x_SI, x_SI.shape[-1])):
        return torch._grouped_mm(x_SI.t(), grad_y_SO.contiguous(), offs=offsets_E1[1:].int())
    grad_w_EIO = x_SI.new_zeros(num_experts, x_SI.shape[-1], grad_y_SO.shape[-1])
    bounds = _bounds(offsets_E1)
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(x_SI[lo:hi].t(), grad_y_SO[lo:hi], out=grad_w_EIO[e])
    return grad_w_EIO
