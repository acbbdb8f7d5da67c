"""The CUDA fast-path rules of torch._grouped_mm, one case per rule (PyTorch's CUDA sources)."""

from __future__ import annotations

import pytest
import torch

from memfine.counts.grouped_mm_rules import cuda_grouped_mm_call

BF16 = torch.bfloat16


def _offs(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _misaligned(rows: int, cols: int) -> torch.Tensor:
    """A bf16 (rows, cols) tensor whose data pointer is 2 bytes past a 16-byte boundary."""
    return torch.randn(rows * cols + 1, dtype=BF16)[1:].view(rows, cols)


def test_aligned_bf16_forward_and_weight_gradient_take_the_fast_path() -> None:
    x_SI, w_EIO = torch.randn(8, 16, dtype=BF16), torch.randn(2, 16, 8, dtype=BF16)
    dy_SO = torch.randn(8, 8, dtype=BF16)
    forward = cuda_grouped_mm_call(x_SI, w_EIO, _offs(0, 8))  # empty group 0: fine in 2d-3d
    grad_w = cuda_grouped_mm_call(x_SI.t(), dy_SO, _offs(0, 8))  # column-major A, row-major B
    transposed_w = cuda_grouped_mm_call(x_SI, torch.randn(2, 8, 16, dtype=BF16).transpose(1, 2),
                                        _offs(3, 8))
    for call in (forward, grad_w, transposed_w):
        assert call.fast_path, call.problems
    assert (forward.layout, grad_w.layout) == ("2d-3d", "2d-2d")
    assert grad_w.empty_groups == 1 and grad_w.groups == 2


CASES = [
    pytest.param(lambda: (torch.randn(8, 16), torch.randn(2, 16, 8), _offs(4, 8)), "not bf16",
                 id="fp32_fallback"),
    pytest.param(lambda: (_misaligned(8, 16), torch.randn(2, 16, 8, dtype=BF16), _offs(4, 8)),
                 "A data_ptr not 16-byte aligned", id="misaligned_pointer"),
    pytest.param(lambda: (torch.randn(8, 16, dtype=BF16), torch.randn(1024, 16, 8, dtype=BF16),
                          _offs(*[8] * 1024)), "1024 groups", id="1024_groups"),
    pytest.param(lambda: (torch.randn(8, 12, dtype=BF16)[:, :4], torch.randn(2, 4, 8, dtype=BF16),
                          _offs(4, 8)), "leading stride 12", id="stride_not_16_bytes"),
    pytest.param(lambda: (torch.randn(8, 16, dtype=BF16)[:, ::2], torch.randn(2, 8, 8, dtype=BF16),
                          _offs(4, 8)), "invalid for sizes", id="no_unit_stride"),
    pytest.param(lambda: (torch.randn(8, 16, dtype=BF16), torch.randn(8, 8, dtype=BF16),
                          _offs(0, 8)), "empty group in a 2d-2d", id="empty_group_row_major_A"),
    pytest.param(lambda: (torch.randn(16, 8, dtype=BF16).t(), torch.randn(16, 8, dtype=BF16),
                          _offs(3, 16)), None, id="ragged_column_major_A_any_rows"),
    pytest.param(lambda: (torch.randn(8, 16, dtype=BF16), torch.randn(16, 8, dtype=BF16),
                          _offs(3, 16)), "A: a group's rows", id="ragged_row_major_A_3_rows"),
    pytest.param(lambda: (torch.randn(2, 8, 16, dtype=BF16), torch.randn(16, 24, dtype=BF16),
                          _offs(4, 24)), "output: a group's rows", id="3d_2d_output_4_rows"),
]


@pytest.mark.parametrize(("make", "problem"), CASES)
def test_each_rule(make, problem: str | None) -> None:
    call = cuda_grouped_mm_call(*make())
    if problem is None:
        assert call.fast_path, call.problems
    else:
        assert not call.fast_path
        assert any(problem in p for p in call.problems), call.problems
