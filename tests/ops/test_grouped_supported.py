"""grouped_mm_supported: the CUDA-only rules (pointer alignment, < 1024 groups) on CUDA tensors.

CUDA is faked by making ``memfine.ops.grouped._on_cuda`` true for CPU tensors; the CPU rules must
stay as they were (the CPU kernel has neither limit).
"""

from __future__ import annotations

import pytest
import torch

from memfine.ops import grouped
from memfine.ops.grouped import grouped_mm_supported, resolve_backend

BF16 = torch.bfloat16


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grouped, "_on_cuda", lambda t: True)


def _offset_rows(rows: int, cols: int, offset: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """A contiguous (rows, cols) tensor starting ``offset`` elements into its storage."""
    return torch.randn(rows * cols + offset, dtype=dtype)[offset:].view(rows, cols)


def test_cpu_rules_unchanged() -> None:
    w = torch.randn(1024, 16, 8, dtype=BF16)
    assert grouped_mm_supported(torch.randn(8, 16, dtype=BF16), w)
    assert grouped_mm_supported(_offset_rows(8, 16, 1), w[:2])  # the CPU kernel reads any pointer


@pytest.mark.usefixtures("fake_cuda")
@pytest.mark.parametrize(("experts", "expected"), [(1023, True), (1024, False)])
def test_cuda_takes_fewer_than_1024_groups(experts: int, expected: bool) -> None:
    w = torch.randn(experts, 16, 8, dtype=BF16)
    x = torch.randn(8, 16, dtype=BF16)
    assert grouped_mm_supported(x, w) is expected
    assert resolve_backend("auto", x, w) == ("grouped_mm" if expected else "loop")
    # a weight gradient passes its group count with a one-group stand-in weight
    assert grouped_mm_supported(x, w[:1], num_groups=experts) is expected


@pytest.mark.usefixtures("fake_cuda")
@pytest.mark.parametrize(("offset", "dtype", "expected"),
                         [(8, BF16, True), (4, BF16, False), (4, torch.float32, True),
                          (2, torch.float32, False)])
def test_cuda_needs_16_byte_aligned_pointers(offset: int, dtype: torch.dtype,
                                             expected: bool) -> None:
    x = _offset_rows(8, 16, offset, dtype)
    w = torch.randn(2, 16, 8, dtype=dtype)
    w_offset = torch.randn(2 * 16 * 8 + offset, dtype=dtype)[offset:].view(2, 16, 8)
    assert grouped_mm_supported(x, w) is expected
    assert grouped_mm_supported(torch.randn(8, 16, dtype=dtype), w_offset) is expected
    # a non-contiguous x is copied before the call, so its offset does not matter
    assert grouped_mm_supported(_offset_rows(16, 8, offset, dtype).t(), w)


@pytest.mark.usefixtures("fake_cuda")
def test_forcing_grouped_mm_on_1024_cuda_groups_raises() -> None:
    x = torch.randn(8, 16, dtype=BF16)
    with pytest.raises(ValueError, match="gemm backend 'grouped_mm'"):
        resolve_backend("grouped_mm", x, torch.randn(1024, 16, 8, dtype=BF16))


def test_weight_without_a_unit_stride_is_rejected() -> None:
    w = torch.randn(2, 16, 64, dtype=BF16)[:, :, ::8]  # strides (1024, 64, 8): 16-byte multiples
    assert not grouped_mm_supported(torch.randn(8, 16, dtype=BF16), w)
