"""Checkpoints: atomic writes and clear errors on bad files (memfine.train.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfine.config import TrainConfig
from memfine.train import checkpoint as ckpt
from memfine.train.optim import build_optimizer


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = torch.nn.Linear(4, 3)
    optimizer, scheduler = build_optimizer(model, TrainConfig())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _save(path: Path, step: int) -> torch.nn.Module:
    model, optimizer, scheduler = _objects()
    ckpt.save_checkpoint(path, step=step, config={"seed": step}, model=model,
                         optimizer=optimizer, scheduler=scheduler)
    return model


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    model = _save(path, 5)
    payload = ckpt.load_checkpoint(path)
    assert payload["step"] == 5 and payload["config"] == {"seed": 5}
    for key, value in model.state_dict().items():
        assert torch.equal(payload["model"][key], value)
    assert payload["scheduler"]["last_epoch"] == 1
    assert torch.equal(payload["rng"]["torch"], torch.get_rng_state())


def test_failed_write_keeps_previous_checkpoint_and_no_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.pt"
    _save(path, 1)
    before = path.read_bytes()

    def broken_save(obj: object, f: object) -> None:
        f.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        _save(path, 2)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert ckpt.load_checkpoint(path)["step"] == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_checkpoint_is_a_value_error_naming_the_path(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "checkpoint.pt"
    _save(path, 3)
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[: len(raw) // 2], "garbage": b"not a checkpoint" * 10,
                      "empty": b""}[damage])
    with pytest.raises(ValueError, match="corrupt or truncated") as info:
        ckpt.load_checkpoint(path)
    assert str(path) in str(info.value)


def test_foreign_file_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="is not a memfine-checkpoint-v1 file"):
        ckpt.load_checkpoint(path)
    with pytest.raises(ValueError, match="no checkpoint at .*missing.pt"):
        ckpt.load_checkpoint(tmp_path / "missing.pt")
