"""PeakMemoryTracker on the CPU: exact bytes of storages created and freed inside the region."""

from __future__ import annotations

import pytest
import torch

from memfine.measure.peak import PeakMemoryTracker


def test_counts_created_storages_until_freed() -> None:
    with PeakMemoryTracker() as tr:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        assert tr.current_bytes == 8000
        del a
        assert tr.current_bytes == 4000
        c = torch.empty(250, dtype=torch.int32)  # 1000 bytes
    assert tr.peak_bytes == 8000
    assert tr.current_bytes == 5000
    del b, c
    assert tr.current_bytes == 5000  # frozen at exit


def test_views_in_place_and_preexisting_storages_are_not_counted() -> None:
    x = torch.zeros(100)
    with PeakMemoryTracker() as tr:
        v = x[10:20]  # view of a storage alive at entry
        x.add_(1.0)  # in place on it
        y = x.view(10, 10).t()  # view again
        z = x * 2  # a new storage: 400 bytes
        w = z[:5]  # a view of a tracked storage: not counted twice
    assert (tr.peak_bytes, tr.current_bytes) == (400, 400)
    assert tr.baseline_bytes is None  # not measured on the CPU
    del v, y, w


def test_out_variant_resize_is_tracked() -> None:
    with PeakMemoryTracker() as tr:
        out = torch.empty(0)
        torch.add(torch.ones(10), 1.0, out=out)  # out grows to 40 bytes; ones: 40, freed
    assert tr.current_bytes == 40
    assert tr.peak_bytes == 80
    del out


def test_forward_backward_phases_and_gradients() -> None:
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(16, 64, requires_grad=True)
    with PeakMemoryTracker() as tr:
        y = (x @ w).relu()  # mm output 16·32·4 = 2048 bytes, freed after relu (relu keeps y)
        loss = y.sum()
        after_forward = tr.mark("forward")
        loss.backward()
    assert after_forward == tr.marks["forward"] == 2048 + 4  # y and the loss scalar
    # backward creates w.grad (8192) and x.grad (4096); they stay alive at exit
    assert tr.current_bytes == 2048 + 4 + 8192 + 4096
    assert tr.phase_peaks["forward"] == 2048 * 2  # mm output and relu output together
    assert tr.peak_bytes == max(tr.phase_peaks.values())
    assert tr.peak_bytes >= tr.current_bytes


def test_misuse_raises() -> None:
    tr = PeakMemoryTracker()
    with pytest.raises(RuntimeError, match="inside the with block"):
        tr.mark("x")
    with tr:
        pass
    with pytest.raises(RuntimeError, match="entered only once"), tr:
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_statistics() -> None:
    keep = torch.empty(1 << 20, device="cuda")  # alive at entry: the baseline
    with PeakMemoryTracker("cuda") as tr:
        a = torch.empty(1 << 20, device="cuda")  # 4 MiB
        b = torch.empty(1 << 20, device="cuda")
        del a
        tr.mark("forward")
        del b
    assert tr.baseline_bytes is not None and tr.baseline_bytes >= keep.numel() * 4
    assert tr.peak_bytes == 8 << 20
    assert tr.marks["forward"] == 4 << 20
    assert tr.current_bytes == 0
