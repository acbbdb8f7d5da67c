"""CUDA RNG states in checkpoints, on CPU through a stand-in for torch.cuda's RNG API.

The stand-in keeps one uint8 state tensor per device, as torch.cuda does; the real-device
round trip (a CUDA draw repeats after resume) is tests/gpu/test_cuda_state.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfine.artifacts import checkpoint as ckpt
from memfine.artifacts.restore import restore
from memfine.config import TrainConfig
from memfine.train.optim import build_optimizer


class FakeCudaRng:
    """torch.cuda's RNG functions over ``devices`` in-memory states."""

    def __init__(self, devices: int, initialized: bool = True) -> None:
        self.states = [torch.full((16,), 10 * i + 1, dtype=torch.uint8) for i in range(devices)]
        self.initialized = initialized

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(cuda, "is_available", lambda: bool(self.states))
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(cuda, "set_rng_state", self.set_state)

    def set_state(self, state: torch.Tensor, device: int) -> None:
        self.states[device] = state.clone()


def _resume(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    model = torch.nn.Linear(4, 3)
    optimizer, scheduler = build_optimizer(model, TrainConfig())
    path = tmp_path / "checkpoint.pt"
    ckpt.save_checkpoint(path, step=3, config={}, model=model, optimizer=optimizer,
                         scheduler=scheduler)
    return path, {**ckpt.read_checkpoint(path), "path": str(path)}


def _restore(payload: dict[str, object]) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer, scheduler = build_optimizer(model, TrainConfig())
    restore(payload, model, optimizer, scheduler, sharded=False)


def test_cuda_states_are_saved_and_restored(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rng = FakeCudaRng(devices=2)
    rng.install(monkeypatch)
    saved = [s.clone() for s in rng.states]
    _, payload = _resume(tmp_path)
    assert [s.tolist() for s in payload["rng"]["cuda"]] == [s.tolist() for s in saved]
    rng.states = [torch.zeros(16, dtype=torch.uint8) for _ in saved]  # the run moved on
    _restore(payload)
    assert [s.tolist() for s in rng.states] == [s.tolist() for s in saved]


def test_fewer_devices_get_the_first_states(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCudaRng(devices=2).install(monkeypatch)
    _, payload = _resume(tmp_path)
    one = FakeCudaRng(devices=1)
    one.states = [torch.zeros(16, dtype=torch.uint8)]
    one.install(monkeypatch)
    _restore(payload)
    assert one.states[0].tolist() == [1] * 16  # device 0's saved state


def test_without_cuda_only_cpu_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCudaRng(devices=1, initialized=False).install(monkeypatch)
    _, payload = _resume(tmp_path)
    assert set(payload["rng"]) == {"torch", "python"}
    FakeCudaRng(devices=1).install(monkeypatch)
    _, gpu_payload = _resume(tmp_path)
    none = FakeCudaRng(devices=0)
    none.install(monkeypatch)
    cpu_state = gpu_payload["rng"]["torch"]
    torch.randn(3)
    _restore(gpu_payload)  # a GPU checkpoint resumed on a CPU machine: CPU states only
    assert torch.equal(torch.get_rng_state(), cpu_state) and none.states == []
