"""Would CUDA's CUTLASS kernel take this ``torch._grouped_mm`` call? Rules read from PyTorch.

Checked on the call's real operands (shapes, strides, data pointers and offset values), so a CPU
run tells what the same call would do on an H100/H200 (SM 9.0/10.0, where ``_grouped_mm_cuda``
enables the fast path). Each rule names where PyTorch enforces it:

- ``aten/src/ATen/native/cuda/GroupedBlas.cpp`` (``_grouped_mm_cuda``): the CUTLASS kernel
  (``bf16bf16_grouped_mm``, "fast path, no d2h sync needed") runs only when both operands and the
  output are bfloat16 and the device is SM 9.0/10.0; every other call takes
  ``_grouped_mm_fallback``, which copies the offsets to the host (``offs.cpu()``) and runs one
  ``mm`` per group.
- ``aten/src/ATen/native/GroupedMMUtils.h`` (``_grouped_mm_validate_inputs`` and
  ``check_valid_strides_and_return_transposed``, run for every CUDA call): operands 2-D or 3-D,
  offsets 1-D int32, given iff an operand is 2-D; data pointers 16-byte aligned on CUDA
  ("expected data_ptr to be aligned to 16 bytes"); of the last two dims one has stride 1 and the
  other a stride ≥ its partner's size and a multiple of 16 bytes.
- ``aten/src/ATen/native/cuda/GroupMM.cu`` (``bf16bf16_grouped_gemm_impl_sm90_sm100``): fewer
  than 1024 groups ("Can't process more than 1024 groups": one thread per group prepares the
  problem); a 3-D operand's per-group pointer ``base + g·stride[0]`` must stay 16-byte aligned
  (TMA), so its batch stride is a multiple of 16 bytes.
- ``aten/src/ATen/native/cuda/GroupMMCommon.cuh`` (``prepare_grouped_gemm_data``, device
  asserts per group): 2-D × 2-D (ragged K, the weight-gradient form) accepts empty groups only
  when A is column-major and B row-major (A = Xᵀ as a transposed view, B = dY contiguous);
  otherwise every group needs ≥ 1 row. Groups other than the last must have a multiple of
  16 bytes of rows along a dynamic dimension that is strided (2-D × 2-D: row-major A or
  column-major B; 2-D × 3-D: column-major A; 3-D × 2-D: always, for the output).

Legend: S rows (the ragged dimension), E groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN_BYTES = 16
MAX_GROUPS = 1023
"""The CUTLASS kernel's limit: ``group_count < 1024``."""


@dataclass(frozen=True, slots=True)
class GroupedMMCall:
    """One ``torch._grouped_mm`` call and whether CUDA's CUTLASS fast path would take it.

    Attributes:
        phase: ``forward`` or ``backward``.
        layout: ``2d-3d`` (rows × per-expert weight), ``3d-2d``, ``2d-2d`` (weight gradient:
            ragged contraction) or ``3d-3d`` (batched).
        dtype: the operands' dtype, e.g. ``torch.bfloat16``.
        a_shape: mat_a's sizes. a_stride: its strides (elements).
        b_shape: mat_b's sizes. b_stride: its strides (elements).
        groups: the group count the kernel sees.
        empty_groups: groups with no rows (``None`` without offsets).
        problems: the rules this call breaks (empty: the fast path takes it).
    """

    phase: str
    layout: str
    dtype: str
    a_shape: tuple[int, ...]
    a_stride: tuple[int, ...]
    b_shape: tuple[int, ...]
    b_stride: tuple[int, ...]
    groups: int
    empty_groups: int | None
    problems: tuple[str, ...]

    @property
    def fast_path(self) -> bool:
        """True when every rule holds (bf16 CUTLASS kernel, no host sync)."""
        return not self.problems


def _matrix_problems(name: str, mat: torch.Tensor) -> list[str]:
    """Pointer and stride rules of one operand (GroupedMMUtils.h, GroupMM.cu)."""
    size = mat.element_size()
    found = []
    if mat.data_ptr() % ALIGN_BYTES:
        found.append(f"{name} data_ptr not 16-byte aligned")
    if mat.dim() not in (2, 3):
        return [*found, f"{name} must be 2-D or 3-D, got {mat.dim()}-D"]
    rows, cols = mat.shape[-2:]
    row_stride, col_stride = mat.stride()[-2:]
    if row_stride == 1 and col_stride >= max(1, rows):
        lead = col_stride
    elif col_stride == 1 and row_stride >= max(1, cols):
        lead = row_stride
    else:
        return [*found, f"{name} strides {mat.stride()} invalid for sizes {tuple(mat.shape)}"]
    if lead * size % ALIGN_BYTES:
        found.append(f"{name} leading stride {lead} not a multiple of 16 bytes")
    if mat.dim() == 3 and mat.shape[0] > 1 and mat.stride(0) * size % ALIGN_BYTES:
        found.append(f"{name} batch stride {mat.stride(0)} not a multiple of 16 bytes")
    return found


def _group_problems(layout: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                    sizes: list[int]) -> list[str]:
    """Per-group device asserts of ``prepare_grouped_gemm_data`` (GroupMMCommon.cuh)."""
    a_row_major, b_row_major = a.stride(-1) == 1, b.stride(-1) == 1
    found = []
    if any(s < 0 for s in sizes):
        found.append("offsets decrease")
    strided: list[tuple[str, torch.dtype]] = []
    if layout == "2d-2d":
        if not (not a_row_major and b_row_major) and 0 in sizes:
            found.append("empty group in a 2d-2d call whose A is not column-major with a "
                         "row-major B")
        strided += [("A", a.dtype)] if a_row_major else []
        strided += [("B", b.dtype)] if not b_row_major else []
    elif layout == "2d-3d" and not a_row_major:
        strided.append(("A", a.dtype))
    elif layout == "3d-2d":
        strided.append(("output", out_dtype))
        strided += [("B", b.dtype)] if b_row_major else []
    for name, dtype in strided:
        align = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
        if any(s % align for s in sizes[:-1]):
            found.append(f"{name}: a group's rows are not a multiple of 16 bytes")
    return found


def cuda_grouped_mm_call(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None, phase: str = "forward"
                         ) -> GroupedMMCall:
    """Check one call's operands against the CUDA fast-path rules (module docstring).

    Reads the offsets' values (a host read: call it outside any region being counted).

    Args:
        a: mat_a, (S, I) / (E, M, I) / (I, S).
        b: mat_b, (E, I, O) / (I, S) / (S, O).
        offs: (E,) int32 cumulative group ends, or ``None``.
        out_dtype: the requested output dtype (``None``: a's).
        phase: recorded as given.

    Returns:
        The call with the rules it breaks.
    """
    layout = f"{a.dim()}d-{b.dim()}d"
    out_dtype = out_dtype or a.dtype
    problems = [f"dtype {a.dtype}/{b.dtype}->{out_dtype} is not bf16 (per-group fallback, "
                "copies offsets to the host)"
                ] if {a.dtype, b.dtype, out_dtype} != {torch.bfloat16} else []
    problems += _matrix_problems("A", a) + _matrix_problems("B", b)
    groups = {"2d-3d": b.shape[0], "3d-2d": a.shape[0]}.get(layout, a.shape[0])
    empty = None
    if (offs is not None) != ("2" in layout):
        problems.append("offsets must be given iff an operand is 2-D")
    if offs is not None:
        if offs.dim() != 1 or offs.dtype != torch.int32:
            problems.append(f"offsets must be 1-D int32, got {offs.dim()}-D {offs.dtype}")
        ends = [int(v) for v in offs.reshape(-1).tolist()]
        sizes = [hi - lo for lo, hi in zip([0, *ends[:-1]], ends, strict=True)]
        groups = len(ends) if layout == "2d-2d" else groups
        empty = sizes.count(0)
        if "2d" in layout:
            problems += _group_problems(layout, a, b, out_dtype, sizes)
    if groups > MAX_GROUPS:
        problems.append(f"{groups} groups (the kernel takes fewer than 1024)")
    return GroupedMMCall(phase=phase, layout=layout, dtype=str(a.dtype),
                         a_shape=tuple(a.shape), a_stride=tuple(a.stride()),
                         b_shape=tuple(b.shape), b_stride=tuple(b.stride()), groups=groups,
                         empty_groups=empty, problems=tuple(problems))
