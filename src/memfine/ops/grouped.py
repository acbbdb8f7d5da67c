"""Grouped GEMM backends over expert-grouped rows, behind one signature.

Legend: S routed rows, E experts, I input features, O output features.
Rows of expert e are [offsets[e], offsets[e+1]). Backends:
- ``grouped_mm``: ``torch._grouped_mm`` (fp32/bf16; int32 offsets; every non-unit stride of the
  operands and the output's row length × itemsize a multiple of 16 bytes). Empty groups give
  exactly zero weight gradients.
- ``loop``: one matmul per expert; any dtype (float64 references), any size. Registered as the
  ``memfine::grouped_mm_loop`` / ``memfine::grouped_weight_grad_loop`` custom ops, whose fake
  impls give output shapes without reading the offsets (FakeTensorMode / meta estimates).
- ``triton``: optional GPU kernels (``memfine[triton]``), loaded only when chosen.
``auto`` picks ``grouped_mm`` when its rules hold, else ``loop``. The choice reads only facts
fixed at trace time (dtype, device, shapes, strides), never whether a tensor is fake, so eager,
``FakeTensorMode`` and ``torch.compile`` take the same path.

``torch._grouped_mm``'s meta kernel (what ``torch.compile`` and ``FakeTensorMode`` run) accepts
bf16 only, although the CPU kernel also computes fp32. fp32 operands therefore reach it through
the ``memfine::grouped_mm_aten`` custom op, whose fake impl gives the output shape, while tracing
or under ``FakeTensorMode`` (real fp32 tensors in eager mode call the ATen op directly, the same
kernel without the custom op's call overhead); bf16 operands call ``torch._grouped_mm`` directly,
so a compiler sees (and may replace) the ATen op.
Reference: docs/design.md §8 (grouped_mm rules measured on CPU).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

BACKENDS = ("auto", "grouped_mm", "loop", "triton")
_GMM_DTYPES = (torch.float32, torch.bfloat16)
_GMM_ALIGN_BYTES = 16


def _strides_aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return all(stride * size % _GMM_ALIGN_BYTES == 0
               for stride, dim in zip(t.stride(), t.shape, strict=True) if stride != 1 and dim > 1)


# CUDA-only rules of ``torch._grouped_mm`` (PyTorch's aten/src/ATen/native/GroupedMMUtils.h and
# cuda/GroupMM.cu): 16-byte-aligned data pointers and fewer than 1024 groups.
_GMM_CUDA_MAX_GROUPS = 1023


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _unit_stride_layout(w_EIO: torch.Tensor) -> bool:
    """One of the last two dims has stride 1, the other a stride ≥ its partner's size."""
    (rows, cols), (row_stride, col_stride) = w_EIO.shape[-2:], w_EIO.stride()[-2:]
    return ((col_stride == 1 and row_stride >= max(1, cols))
            or (row_stride == 1 and col_stride >= max(1, rows)))


def _cuda_rules_hold(x_SI: torch.Tensor, w_EIO: torch.Tensor, num_groups: int) -> bool:
    """Pointer alignment and group count, read from storage offsets (known while tracing).

    The caching allocator hands out 512-byte-aligned blocks, so a data pointer is 16-byte
    aligned iff its storage offset is a multiple of 16 bytes. A non-contiguous x is copied
    (offset 0) before the call.
    """
    size = x_SI.element_size()
    x_offset_ok = not x_SI.is_contiguous() or x_SI.storage_offset() * size % _GMM_ALIGN_BYTES == 0
    w_offset_ok = w_EIO.storage_offset() * size % _GMM_ALIGN_BYTES == 0
    return x_offset_ok and w_offset_ok and num_groups <= _GMM_CUDA_MAX_GROUPS


def grouped_mm_supported(x_SI: torch.Tensor, w_EIO: torch.Tensor, *,
                         num_groups: int | None = None) -> bool:
    """True when ``torch._grouped_mm`` accepts these operands (dtype, alignment, device).

    Every device: fp32/bf16, row lengths × itemsize and the weight's non-unit strides multiples
    of 16 bytes, one of the weight's last two strides 1. On CUDA also (PyTorch's
    ``check_valid_strides_and_return_transposed`` in aten/src/ATen/native/GroupedMMUtils.h and
    ``bf16bf16_grouped_gemm_impl_sm90_sm100`` in aten/src/ATen/native/cuda/GroupMM.cu): both
    data pointers 16-byte aligned (read as storage offsets) and fewer than 1024 groups (the
    fp32 per-group fallback has no such limit, but it syncs per call: the loop is no worse).

    Args:
        x_SI: (S, I) grouped rows (made contiguous before the call).
        w_EIO: (E, I, O) weights, any strides.
        num_groups: the groups of the call (``None``: E = ``w_EIO.shape[0]``); a weight
            gradient (2-D × 2-D) passes its expert count with a one-group stand-in weight.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x_SI.dtype not in _GMM_DTYPES or w_EIO.dtype != x_SI.dtype:
        return False
    if x_SI.device.type not in ("cpu", "cuda"):
        return False
    size = x_SI.element_size()
    rows_aligned = (x_SI.shape[-1] * size % _GMM_ALIGN_BYTES == 0
                    and w_EIO.shape[-1] * size % _GMM_ALIGN_BYTES == 0)
    if not (rows_aligned and _strides_aligned(w_EIO) and _unit_stride_layout(w_EIO)):
        return False
    groups = w_EIO.shape[0] if num_groups is None else num_groups
    return not _on_cuda(x_SI) or _cuda_rules_hold(x_SI, w_EIO, groups)


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
            "gemm backend 'grouped_mm' needs fp32/bf16 operands whose row lengths × itemsize "
            f"are multiples of 16 bytes; got x {tuple(x_SI.shape)} {x_SI.dtype}, "
            f"w {tuple(w_EIO.shape)} {w_EIO.dtype}; use 'auto' or 'loop'")
    return backend


# dtypes whose ``torch._grouped_mm`` meta kernel gives shapes; others go through the custom op.
_GMM_META_DTYPES = (torch.bfloat16,)


@torch.library.custom_op("memfine::grouped_mm_aten", mutates_args=())
def _grouped_mm_aten(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs).contiguous()


@_grouped_mm_aten.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:  # (S, I) x (E, I, O) -> (S, O)
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])  # (I, S) x (S, O) -> (E, I, O)


def _runs_eagerly(a: torch.Tensor) -> bool:
    """True for a real tensor outside tracing (not compiling, not fake, not meta).

    The custom op (whose eager call costs ~0.15 ms more on the CPU) is needed only where a
    fake/meta kernel gives the shape.
    """
    return (not torch.compiler.is_compiling() and a.device.type != "meta"
            and not isinstance(a, FakeTensor))


_WARNED_FP32_CUDA: list[bool] = []


def _warn_fp32_cuda(a: torch.Tensor) -> None:
    """Warn once per process when fp32 operands reach ``torch._grouped_mm`` on CUDA.

    Its CUDA kernel computes bf16 only; fp32 takes a per-group fallback that copies the offsets
    to the host on every call (one stream sync per GEMM). Train under ``torch.autocast`` with
    bf16 (``memfine train --device cuda`` does), or hold the weights in bf16.
    """
    if a.device.type == "cuda" and a.dtype == torch.float32 and not _WARNED_FP32_CUDA:
        _WARNED_FP32_CUDA.append(True)
        import warnings

        warnings.warn("memfine: fp32 grouped GEMMs on CUDA take torch._grouped_mm's per-group "
                      "fallback, which syncs with the host on every call; run the experts in "
                      "bf16 (torch.autocast(device_type='cuda', dtype=torch.bfloat16))",
                      stacklevel=3)


def _aten_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets_E1: torch.Tensor
                     ) -> torch.Tensor:
    """``torch._grouped_mm`` with cumulative ends ``offsets[1:]``; see the module docstring."""
    _warn_fp32_cuda(a)
    offs_E = offsets_E1[1:].int()
    if a.dtype in _GMM_META_DTYPES or _runs_eagerly(a):
        return torch._grouped_mm(a, b, offs=offs_E)
    out: torch.Tensor = torch.ops.memfine.grouped_mm_aten(a, b, offs_E)
    return out


@torch.library.custom_op("memfine::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor
                     ) -> torch.Tensor:
    out_SO = x_SI.new_empty(x_SI.shape[0], w_EIO.shape[-1])
    bounds = offsets_E1.tolist()
    for e in range(w_EIO.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(x_SI[lo:hi], w_EIO[e], out=out_SO[lo:hi])
    return out_SO


@_grouped_mm_loop.register_fake
def _(x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    return x_SI.new_empty(x_SI.shape[0], w_EIO.shape[-1])


@torch.library.custom_op("memfine::grouped_weight_grad_loop", mutates_args=())
def _grouped_weight_grad_loop(x_SI: torch.Tensor, grad_y_SO: torch.Tensor,
                              offsets_E1: torch.Tensor, num_experts: int) -> torch.Tensor:
    grad_w_EIO = x_SI.new_zeros(num_experts, x_SI.shape[-1], grad_y_SO.shape[-1])
    bounds = offsets_E1.tolist()
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(x_SI[lo:hi].t(), grad_y_SO[lo:hi], out=grad_w_EIO[e])
    return grad_w_EIO


@_grouped_weight_grad_loop.register_fake
def _(x_SI: torch.Tensor, grad_y_SO: torch.Tensor, offsets_E1: torch.Tensor,
      num_experts: int) -> torch.Tensor:
    return x_SI.new_empty(num_experts, x_SI.shape[-1], grad_y_SO.shape[-1])


def grouped_mm(x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor,
               backend: str = "auto") -> torch.Tensor:
    """Y[rows of e] = X[rows of e] · W[e] for every expert e.

    Not an autograd op (the ``loop`` and ``triton`` custom ops have no derivative): call it from
    a custom Function, or use :class:`memfine.ops.GroupedMatmulFunction` for autograd.

    Args:
        x_SI: (S, I) rows grouped by expert, float.
        w_EIO: (E, I, O) per-expert weights (any strides; transposed views are fine).
        offsets_E1: (E + 1,) int32 expert_token_offsets, offsets[0] == 0, offsets[E] == S.
        backend: ``auto``, ``grouped_mm``, ``loop`` or ``triton``.

    Returns:
        (S, O) new tensor in x's dtype.

    Raises:
        ValueError: for an unknown or unusable backend.

    A ``w_EIO`` that is not a tensor but computes its own product (a 4-bit base's experts,
    :class:`memfine.lora.quant.NF4Block`) is handed the call.
    """
    if not isinstance(w_EIO, torch.Tensor):  # a weight that computes its own product
        return w_EIO.grouped_mm(x_SI, offsets_E1, backend)
    backend = resolve_backend(backend, x_SI, w_EIO)
    if backend == "grouped_mm":
        return _aten_grouped_mm(x_SI.contiguous(), w_EIO, offsets_E1)
    if backend == "triton":
        from memfine.triton_kernels import grouped_mm as triton_grouped_mm

        return triton_grouped_mm(x_SI, w_EIO, offsets_E1)
    out: torch.Tensor = torch.ops.memfine.grouped_mm_loop(x_SI, w_EIO, offsets_E1)
    return out


def _is_transposed_view(w_EIO: torch.Tensor) -> bool:
    """True for an (E, I, O) weight stored as (E, O, I) (e.g. a transposed HF weight)."""
    return w_EIO.dim() == 3 and w_EIO.stride(1) == 1 and w_EIO.stride(2) != 1


def grouped_weight_grad(x_SI: torch.Tensor, grad_y_SO: torch.Tensor, offsets_E1: torch.Tensor,
                        num_experts: int, backend: str = "auto", *,
                        like: torch.Tensor | None = None) -> torch.Tensor:
    """dW[e] = X[rows of e]ᵀ · dY[rows of e]; experts with no rows get exact zeros.

    Args:
        x_SI: (S, I) grouped input rows.
        grad_y_SO: (S, O) gradient of the grouped output.
        offsets_E1: (E + 1,) int32 offsets.
        num_experts: E.
        backend: as in :func:`grouped_mm` (``triton`` uses the loop here).
        like: optional (E, I, O) weight whose memory layout the result takes. When it is a
            transposed view of an (E, O, I) tensor, dWᵀ = dYᵀ·X is computed as (E, O, I) and
            returned transposed, so autograd hands the base parameter a gradient in its own
            layout (no strided copy of E·I·O elements in AccumulateGrad).

    Returns:
        (E, I, O) tensor (a transposed view when ``like`` is transposed), exactly zero for
        empty experts.

    Raises:
        ValueError: for an unknown or unusable backend.
    """
    if like is not None and _is_transposed_view(like):
        return grouped_weight_grad(grad_y_SO, x_SI, offsets_E1, num_experts,
                                   backend).transpose(1, 2)
    # dW = Xᵀ·dY is a grouped GEMM with operands (I, S) and (S, O): the same rules as
    # grouped_mm(x (S, I), w (E, I, O)) with row lengths I and O.
    w_like = x_SI.new_empty(1, x_SI.shape[-1], grad_y_SO.shape[-1])
    backend = resolve_backend(backend, x_SI, w_like) if backend != "triton" else "loop"
    if backend == "grouped_mm":
        return _aten_grouped_mm(x_SI.t(), grad_y_SO.contiguous(), offsets_E1)
    out: torch.Tensor = torch.ops.memfine.grouped_weight_grad_loop(
        x_SI, grad_y_SO, offsets_E1, num_experts)
    return out


def grouped_weight_grad_supported(x_SI: torch.Tensor, grad_y_SO: torch.Tensor,
                                  num_groups: int) -> bool:
    """True when dW = Xᵀ·dY can be one ``torch._grouped_mm`` call with empty groups allowed.

    The 2-D × 2-D form with offsets along K (the rows): A = Xᵀ, an (I, S) column-major view of
    the row-major X, and B = dY, (S, O) row-major (any row stride, e.g. a column slice of dH).
    That is the one layout whose CUDA kernel accepts groups with no rows (PyTorch's
    ``prepare_grouped_gemm_data`` in GroupMMCommon.cuh; :mod:`memfine.counts.grouped_mm_rules`);
    the result is a new (E, I, O) tensor, exactly zero for empty groups. Checked without
    allocating: fp32/bf16, the same dtype, CPU or CUDA, both operands with unit column stride
    and row lengths and strides multiples of 16 bytes; on CUDA also 16-byte-aligned storage
    offsets and ``num_groups`` < 1024.

    Args:
        x_SI: (S, I) input rows.
        grad_y_SO: (S, O) output-gradient rows.
        num_groups: E, the groups of the call.
    """
    if not hasattr(torch, "_grouped_mm") or x_SI.dtype not in _GMM_DTYPES:
        return False
    if grad_y_SO.dtype != x_SI.dtype or x_SI.device.type not in ("cpu", "cuda"):
        return False
    size = x_SI.element_size()
    for t in (x_SI, grad_y_SO):
        if t.dim() != 2 or t.stride(1) != 1:
            return False
        if (t.shape[1] * size) % _GMM_ALIGN_BYTES or (t.stride(0) * size) % _GMM_ALIGN_BYTES:
            return False
        if _on_cuda(t) and (t.storage_offset() * size) % _GMM_ALIGN_BYTES:
            return False
    return not _on_cuda(x_SI) or num_groups <= _GMM_CUDA_MAX_GROUPS


def grouped_row_sums(rows_SO: torch.Tensor, offsets_E1: torch.Tensor, num_experts: int
                     ) -> torch.Tensor:
    """dB[e] = Σ_{rows r of e} rows[r] (the gradient of a per-expert bias); empty experts get 0.

    A grouped GEMM with columns of ones (Xᵀ·dY with X = 1), so the sum accumulates as a matmul
    does (fp32 for bf16 rows, blocked; deterministic, no atomics) and stays on the device (no
    host read of the offsets): the ones are 16 bytes wide (4 fp32 or 8 bf16 columns, all equal),
    which meets ``torch._grouped_mm``'s alignment rule; other dtypes run the per-expert loop.

    Args:
        rows_SO: (S, O) rows grouped by expert.
        offsets_E1: (E + 1,) int32 expert_token_offsets.
        num_experts: E.

    Returns:
        (E, O) new tensor in the rows' dtype, exactly zero for experts with no rows.
    """
    width = max(1, _GMM_ALIGN_BYTES // rows_SO.element_size())
    ones_SW = rows_SO.new_ones(rows_SO.shape[0], width)  # NOTE(memory): transient S·16 bytes
    return grouped_weight_grad(ones_SW, rows_SO, offsets_E1, num_experts, "auto")[:, 0]
