"""Triton kernels address elements past 2³¹ (int64 offsets), under TRITON_INTERPRET=1 on CPU.

A T·d of 2³¹ elements needs T ≥ 1,048,576 at d 2048; here a few rows sit 2³⁰ elements apart in
one lazily allocated storage (4 GiB of address space, a few pages touched), so a row index times
a row stride passes 2³¹ as it would at that T. An int32 product would wrap to a negative offset
(a wrong address or a crash). Reference: docs/style.md §6 (kernels under the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from devices import triton_cpu
from tolerances import assert_close

pytest.importorskip("triton", reason="needs triton (pip install 'memfine[triton]')")
pytestmark = triton_cpu

ROWS, D = 3, 16
STRIDE = 2**30 + 64  # elements between rows: row 2 starts past 2**31


@pytest.fixture(scope="module")
def storage() -> torch.Tensor:
    """A flat bf16 buffer of just over 2**31 elements; torch.empty leaves its pages untouched."""
    return torch.empty((ROWS - 1) * STRIDE + 4 * D + D * D, dtype=torch.bfloat16)


def _far_rows(storage: torch.Tensor, slot: int, values: torch.Tensor | None = None
              ) -> torch.Tensor:
    """A (ROWS, D) view whose rows lie STRIDE elements apart, at column offset ``slot · D``."""
    view = storage.as_strided((ROWS, D), (STRIDE, 1), slot * D)
    if values is not None:
        view.copy_(values)
    return view


def test_combine_writes_and_reads_past_2_31(storage: torch.Tensor) -> None:
    from memfine.triton_kernels import kernels

    rows_SD = _far_rows(storage, 0, torch.randn(ROWS, D).bfloat16())
    out_TD = _far_rows(storage, 1, torch.zeros(ROWS, D))
    map_TK = torch.tensor([[2, -1], [0, 1], [1, 2]], dtype=torch.int32)  # -1: a sentinel slot
    assert out_TD.stride(0) * (ROWS - 1) >= 2**31
    kernels._combine_kernel[(1, 1)](rows_SD, map_TK, out_TD, ROWS, D, 2, *rows_SD.stride(),
                                    *map_TK.stride(), *out_TD.stride(), BT=16, BD=16)
    rows = rows_SD.float()
    want = torch.stack([rows[2], rows[0] + rows[1], rows[1] + rows[2]])
    assert_close(out_TD.float(), want, dtype=torch.bfloat16)


def test_grouped_gemm_reads_rows_and_experts_past_2_31(storage: torch.Tensor) -> None:
    from memfine.triton_kernels import grouped_mm

    x_SI = _far_rows(storage, 2, torch.randn(ROWS, D).bfloat16())
    # expert e's (D, D) matrix starts e·STRIDE elements in: expert 2 past 2**31
    w_EIO = storage.as_strided((ROWS, D, D), (STRIDE, D, 1), 4 * D)
    for e in range(ROWS):
        w_EIO[e].copy_(torch.randn(D, D) / D**0.5)
    offsets_E1 = torch.tensor([0, 1, 1, 3], dtype=torch.int32)  # expert 1 empty, 2 owns rows 1-2
    got = grouped_mm(x_SI, w_EIO, offsets_E1)
    x, w = x_SI.double(), w_EIO.double()
    want = torch.cat([x[:1] @ w[0], x[1:] @ w[2]])
    assert_close(got.double(), want, dtype=torch.bfloat16)


def test_gather_up_reads_tokens_past_2_31(storage: torch.Tensor) -> None:
    from memfine.triton_kernels import gather_up

    x_TD = _far_rows(storage, 3, torch.randn(ROWS, D).bfloat16())
    w_up_EDG = (torch.randn(2, D, 2 * D) / D**0.5).bfloat16()
    indices_S = torch.tensor([2, 0, 2, 1], dtype=torch.int32)
    offsets_E1 = torch.tensor([0, 2, 4], dtype=torch.int32)
    h_SG, _ = gather_up(x_TD, w_up_EDG, indices_S, offsets_E1, "swiglu")
    x, w = x_TD.double()[indices_S.long()], w_up_EDG.double()
    want = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    assert_close(h_SG.double(), want, dtype=torch.bfloat16)
