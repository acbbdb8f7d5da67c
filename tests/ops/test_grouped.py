"""Grouped GEMM backends: grouped_mm vs loop, alignment fallback, selection, fake impls.

Reference: docs/design.md §8 (torch._grouped_mm rules on CPU).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfine.ops.grouped import (
    grouped_mm,
    grouped_mm_supported,
    grouped_weight_grad,
    resolve_backend,
)
from tolerances import assert_close

OFFSETS = torch.tensor([0, 3, 3, 8, 10, 10], dtype=torch.int32)  # experts 1 and 4 empty


def _loop_reference(x_SI: torch.Tensor, w_EIO: torch.Tensor) -> torch.Tensor:
    bounds = OFFSETS.tolist()
    return torch.cat([x_SI[bounds[e]:bounds[e + 1]].double() @ w_EIO[e].double()
                      for e in range(w_EIO.shape[0])])


@pytest.mark.parametrize("backend", ["grouped_mm", "loop", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_and_weight_grad(backend: str, dtype: torch.dtype) -> None:
    x_SI = torch.randn(10, 16, dtype=dtype)
    w_EIO = torch.randn(5, 16, 24, dtype=dtype)
    assert_close(grouped_mm(x_SI, w_EIO, OFFSETS, backend), _loop_reference(x_SI, w_EIO),
                 dtype=dtype)
    grad_y_SO = torch.randn(10, 24, dtype=dtype)
    grad_w = grouped_weight_grad(x_SI, grad_y_SO, OFFSETS, 5, backend)
    bounds = OFFSETS.tolist()
    for e in range(5):
        rows = slice(bounds[e], bounds[e + 1])
        want = x_SI[rows].double().t() @ grad_y_SO[rows].double()
        assert_close(grad_w[e], want, grad=True, dtype=dtype)
    assert torch.equal(grad_w[[1, 4]], torch.zeros(2, 16, 24, dtype=dtype))  # exact zeros


@pytest.mark.parametrize(("x_shape", "w_shape", "dtype", "supported"), [
    pytest.param((4, 8), (2, 8, 12), torch.float32, True, id="fp32-aligned"),
    pytest.param((4, 6), (2, 6, 12), torch.float32, False, id="fp32-inner-6"),
    pytest.param((4, 8), (2, 8, 30), torch.float32, False, id="fp32-out-30"),
    pytest.param((4, 12), (2, 12, 8), torch.bfloat16, False, id="bf16-inner-12"),
    pytest.param((4, 16), (2, 16, 8), torch.bfloat16, True, id="bf16-aligned"),
    pytest.param((4, 8), (2, 8, 12), torch.float64, False, id="float64"),
])
def test_alignment_rules(x_shape: tuple[int, int], w_shape: tuple[int, int, int],
                         dtype: torch.dtype, supported: bool) -> None:
    x_SI, w_EIO = torch.randn(x_shape, dtype=dtype), torch.randn(w_shape, dtype=dtype)
    assert grouped_mm_supported(x_SI, w_EIO) is supported
    assert resolve_backend("auto", x_SI, w_EIO) == ("grouped_mm" if supported else "loop")
    if not supported:
        with pytest.raises(ValueError, match="grouped_mm' needs"):
            resolve_backend("grouped_mm", x_SI, w_EIO)


def test_transposed_weight_strides_checked() -> None:
    """w_down (E, n, d) transposed to (E, d, n) has row stride d: alignment follows the strides."""
    w_END = torch.randn(2, 6, 8)  # n = 6: the transposed view's stride n·4 = 24 bytes
    x_SD = torch.randn(5, 8)
    assert not grouped_mm_supported(x_SD, w_END.transpose(1, 2))
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    got = grouped_mm(x_SD, w_END.transpose(1, 2), offsets)  # auto → loop
    want = torch.cat([x_SD[:2] @ w_END[0].t(), x_SD[2:] @ w_END[1].t()])
    assert_close(got, want)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="gemm backend must be one of"):
        grouped_mm(torch.randn(2, 4), torch.randn(1, 4, 4), torch.tensor([0, 2]), "cutlass")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_backends_have_fake_impls(backend: str, dtype: torch.dtype) -> None:
    """Under FakeTensorMode every backend gives shapes without reading the offsets, and auto
    chooses as in eager (fp32 reaches _grouped_mm through a custom op: its meta kernel accepts
    bf16 only)."""
    with FakeTensorMode():
        x_SI, w_EIO = torch.empty(10, 8, dtype=dtype), torch.empty(5, 8, 16, dtype=dtype)
        offsets = torch.empty(6, dtype=torch.int32)
        assert resolve_backend("auto", x_SI, w_EIO) == "grouped_mm"
        assert grouped_mm(x_SI, w_EIO, offsets, backend).shape == (10, 16)
        grad_w = grouped_weight_grad(x_SI, torch.empty(10, 16, dtype=dtype), offsets, 5, backend)
        assert grad_w.shape == (5, 8, 16)
        assert grad_w.dtype == dtype


def test_backend_choice_is_the_same_in_eager_and_fake() -> None:
    """The choice reads dtype, shapes and strides only (the same facts in both modes)."""
    cases = [((10, 8), (5, 8, 12), torch.float32), ((10, 6), (5, 6, 12), torch.float32),
             ((10, 12), (5, 12, 8), torch.bfloat16), ((10, 16), (5, 16, 8), torch.bfloat16)]
    eager = [resolve_backend("auto", torch.empty(x, dtype=d), torch.empty(w, dtype=d))
             for x, w, d in cases]
    with FakeTensorMode():
        fake = [resolve_backend("auto", torch.empty(x, dtype=d), torch.empty(w, dtype=d))
                for x, w, d in cases]
    assert eager == fake == ["grouped_mm", "loop", "loop", "grouped_mm"]
