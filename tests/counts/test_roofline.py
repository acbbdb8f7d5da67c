"""The roofline floor: FLOPs and bytes per op against hand counts, GPUs by name."""

from __future__ import annotations

import pytest
import torch

from memfine.counts.ops_count import OpCounter
from memfine.counts.roofline import GPUS, floor_ms, gpu


def test_matmul_and_in_place_traffic_at_mapped_dims() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with OpCounter(dim_map={32: 320}) as counter:
        y = a @ b  # mm: (64, 320)·(320, 16) at the real dims
        y.add_(1)  # in place: read and written
        torch.empty_like(y)  # an allocation writes nothing
        torch.zeros_like(y)  # a fill writes its output only
    traffic = counter.total().traffic
    mm_bytes = (64 * 320 + 320 * 16 + 64 * 16) * 4
    assert traffic == [(2 * 64 * 320 * 16, mm_bytes), (0, 2 * 64 * 16 * 4), (0, 0),
                       (0, 64 * 16 * 4)]
    assert counter.total().hbm_bytes == mm_bytes + 3 * 64 * 16 * 4


def test_grouped_mm_flops_count_each_row_once() -> None:
    x = torch.randn(48, 16, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 32, dtype=torch.bfloat16)
    offs = torch.tensor([10, 30, 48], dtype=torch.int32)
    with OpCounter() as counter:
        torch._grouped_mm(x, w, offs=offs)
        torch._grouped_mm(x.t(), torch.randn(48, 32, dtype=torch.bfloat16), offs=offs)
    flops = [f for f, _ in counter.total().traffic if f]
    assert flops == [2 * 48 * 16 * 32, 2 * 16 * 48 * 32]


def test_floor_is_the_sum_of_per_op_maxima() -> None:
    h200 = GPUS["h200"]
    traffic = [(int(989e12), 0), (0, int(4.8e12)), (int(989e9), int(4.8e12))]
    assert floor_ms(traffic, "h200") == pytest.approx(1e3 * (1 + 1 + 1))
    assert h200.flops_per_s == 989e12 and h200.bytes_per_s == 4.8e12
    assert GPUS["h100"].bytes_per_s == 3.35e12 and "datasheet" in GPUS["h100"].source


def test_unknown_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match=r"roofline GPU must be one of \('h100', 'h200'\), "
                                         r"got 'a100'"):
        gpu("a100")
    with pytest.raises(ValueError, match="got 'b200'"):
        floor_ms([], "b200")
