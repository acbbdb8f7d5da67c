"""SavedTensorsTracker: exact saved-for-backward bytes on small hand-computed graphs."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfine.measure.saved import SavedGroup, SavedTensor, SavedTensorsTracker, track_saved_tensors


def test_matmul_saves_input_not_parameter() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    linear = nn.Linear(3, 5, bias=False)
    with SavedTensorsTracker() as saved:
        linear(x)
    # mm keeps x (4·3·4 = 48 bytes) and the weight (a Parameter: left out).
    assert saved.total_bytes == 48
    assert saved.items == [SavedTensor(shape=(4, 3), dtype=torch.float32, nbytes=48)]


def test_exclude_plain_tensor_weights() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    with track_saved_tensors() as with_w:
        x @ w
    with track_saved_tensors(exclude=[w]) as without_w:
        x @ w
    assert with_w.total_bytes == 48 + 60
    assert without_w.total_bytes == 48


def test_storage_counted_once_across_views() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with track_saved_tensors() as saved:
        y = x * x.t().t()  # mul saves both operands: one storage
        z = y.exp()  # exp saves its result: (4, 3) fp32
        (x[:2] * 2.0 * z[:2]).sum()  # views of saved storages add nothing new... except x[:2]*2
    # x: 48 bytes; exp result: 48; (x[:2]*2.0) is a new (2, 3) tensor saved by the last mul:
    # 24 bytes; z[:2] is a view of z's storage (already counted).
    assert saved.total_bytes == 48 + 48 + 24
    assert len(saved.items) == 3


def test_view_counts_its_whole_storage() -> None:
    base = torch.randn(10, dtype=torch.float64, requires_grad=True)
    with track_saved_tensors() as saved:
        (base[:2] * base[2:4]).sum()
    # Both views keep base's whole storage (10 · 8 bytes) alive; counted once.
    assert saved.total_bytes == 80
    assert saved.items[0].shape == (2,)


def test_groups_and_table() -> None:
    a = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    with track_saved_tensors() as saved:
        (a * b).sum()
        torch.cat([a, b]).float().exp()  # saves the fp32 exp result (4, 8): 128 bytes
    # Largest group first; each bf16 (2, 8) input is 32 bytes.
    assert saved.groups() == [
        SavedGroup(shape=(4, 8), dtype=torch.float32, count=1, nbytes=128),
        SavedGroup(shape=(2, 8), dtype=torch.bfloat16, count=2, nbytes=64),
    ]
    assert saved.total_bytes == 192
    lines = saved.table().splitlines()
    assert lines[1].split()[-2:] == ["1", "0.000"] and lines[-1].split()[:2] == ["total", "3"]


def test_nothing_saved_without_grad() -> None:
    x = torch.randn(4, 3)
    with track_saved_tensors() as saved:
        (x @ x.t()).exp()
    assert saved.total_bytes == 0 and saved.items == []


def test_fake_tensors_give_same_bytes() -> None:
    with FakeTensorMode():
        x = torch.empty(64, 32, requires_grad=True)
        linear = nn.Linear(32, 16, bias=False)
        with track_saved_tensors() as saved:
            torch.relu(linear(x))
    # mm keeps x (64·32·4 = 8192 bytes); relu keeps its (64, 16) result (4096 bytes).
    assert saved.total_bytes == 8192 + 4096
