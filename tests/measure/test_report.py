"""measure_memory / measure_backward reports and the predicted-vs-measured table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfine.measure import (
    ComparisonRow,
    MemoryReport,
    compare,
    format_table,
    measure_backward,
    measure_memory,
)
from memfine.units import format_bytes


def test_report_of_a_product() -> None:
    """y = (a * b).sum(): mul saves a and b (64 + 64 bytes); a.grad and b.grad are created."""
    a = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    idx = torch.arange(4)
    with measure_memory() as m:
        prod = a * b  # 64 bytes
        picked = prod.index_select(0, idx)  # saves idx (int64, 32 bytes): an index item
        loss = picked.sum()  # 4 bytes
        m.end_forward()
        loss.backward()
    r = m.report()
    assert r.saved_bytes == 64 + 64 + 32
    assert (r.saved_float_bytes, r.saved_index_bytes) == (128, 32)
    assert r.after_forward_bytes == 64 + 16 + 4  # prod, picked, loss (a, b, idx existed)
    assert r.retained_bytes == r.after_forward_bytes + 64 + 64  # + a.grad + b.grad
    assert r.peak_bytes is not None and r.peak_bytes >= r.retained_bytes
    assert r.forward_peak_bytes == 84
    assert r.backward_peak_bytes == r.peak_bytes
    assert r.baseline_bytes is None


def test_parameters_and_excluded_tensors_are_not_saved_bytes() -> None:
    layer = torch.nn.Linear(8, 4, bias=False)
    w_plain = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)

    def forward() -> list[torch.Tensor]:
        return [layer(x) + x @ w_plain]

    r = measure_backward(forward, [torch.ones(3, 4)], exclude=[w_plain])
    assert r.saved_bytes == x.numel() * 4  # x, saved by both matmuls, counted once


def test_end_forward_twice_raises() -> None:
    with measure_memory() as m:
        m.end_forward()
        with pytest.raises(RuntimeError, match="already called"):
            m.end_forward()


def test_unmeasured_values_are_none_and_shown_as_such() -> None:
    r = MemoryReport(saved_bytes=10)
    assert r.peak_bytes is None
    assert set(r.to_dict()) == {f.name for f in dataclasses.fields(MemoryReport)}
    assert format_bytes(None) == "not measured"
    row = ComparisonRow(name="peak", predicted_bytes=100, measured_bytes=None)
    assert row.ratio is None
    assert "not measured" in format_table([row])


def test_format_bytes_uses_binary_units() -> None:
    assert format_bytes(3 << 30) == "3.00 GiB"
    assert format_bytes(1536 << 10) == "1.50 MiB"
    assert format_bytes(512, digits=4) == "0.0005 MiB"
    assert "GB" not in format_bytes(5 << 30).replace("GiB", "")


def test_compare_rows_and_table() -> None:
    rows = compare({"saved": 100, "peak": 300}, {"saved": 100, "peak": 200})
    assert [(r.name, r.ratio) for r in rows] == [("saved", 1.0), ("peak", 1.5)]
    table = format_table(rows).splitlines()
    assert table[0].split()[:4] == ["item", "predicted", "bytes", "measured"]
    assert table[2].split()[:4] == ["peak", "300", "200", "1.5000"]
