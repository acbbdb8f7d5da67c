"""Checkpoints: atomic writes and clear errors on bad files (memfine.artifacts.checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from memfine.artifacts import checkpoint as ckpt
from memfine.artifacts.restore import load_states, restore
from memfine.config import TrainConfig
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


def _save_sharded(out: Path, step: int) -> torch.nn.Module:
    model, optimizer, scheduler = _objects()
    ckpt.save_sharded_checkpoint(out / ckpt.SHARDED_NAME, step=step, config={"seed": step},
                                 model=model, optimizer=optimizer, scheduler=scheduler,
                                 is_main=True, barrier=lambda: None)
    return model


def _loaded(out: Path) -> tuple[int, torch.nn.Module]:
    """Step and model of the newest checkpoint in ``out``, loaded into fresh objects."""
    payload = ckpt.read_checkpoint(ckpt.find_checkpoint(out))
    model = torch.nn.Linear(4, 3)
    optimizer, _ = build_optimizer(model, TrainConfig())
    load_states(payload, model, optimizer, sharded=False)
    return int(payload["step"]), model


def test_sharded_round_trip_and_either_form_loads(tmp_path: Path) -> None:
    model = _save_sharded(tmp_path, 4)
    step, loaded = _loaded(tmp_path)
    assert step == 4
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    _save(tmp_path / ckpt.CHECKPOINT_NAME, 6)  # the one-file form replaces the directory
    assert not (tmp_path / ckpt.SHARDED_NAME).exists()
    assert _loaded(tmp_path)[0] == 6
    _save_sharded(tmp_path, 8)  # and back: the directory replaces the file
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.SHARDED_NAME]
    assert _loaded(tmp_path)[0] == 8


def test_killed_sharded_save_leaves_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_sharded(tmp_path, 1)

    def killed_save(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # a kill while the shards are written

    with monkeypatch.context() as m:
        m.setattr(ckpt.dcp, "save", killed_save)
        with pytest.raises(KeyboardInterrupt):
            _save_sharded(tmp_path, 2)
    assert _loaded(tmp_path)[0] == 1
    replace = ckpt.os.replace
    calls = []

    def killed_between_renames(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) == 3:  # meta.pt, then old checkpoint aside, then the new one in: killed
            raise KeyboardInterrupt
        replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt.os, "replace", killed_between_renames)
    with pytest.raises(KeyboardInterrupt):
        _save_sharded(tmp_path, 3)
    assert not (tmp_path / ckpt.SHARDED_NAME).exists()
    assert ckpt.find_checkpoint(tmp_path).name == ckpt.SHARDED_NAME + ".old"
    assert _loaded(tmp_path)[0] == 1
    monkeypatch.setattr(ckpt.os, "replace", replace)
    _save_sharded(tmp_path, 4)  # the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.SHARDED_NAME]
    assert _loaded(tmp_path)[0] == 4


def test_restore_loads_every_state_and_the_rng(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    model = _save(path, 7)
    saved_rng = torch.get_rng_state()
    payload = {**ckpt.read_checkpoint(path), "path": str(path)}
    fresh = torch.nn.Linear(4, 3)
    optimizer, scheduler = build_optimizer(fresh, TrainConfig())
    torch.randn(5)  # move the RNG on: restore must put it back
    assert restore(payload, fresh, optimizer, scheduler, sharded=False) == 7
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    assert scheduler.last_epoch == 1 and len(optimizer.state) == 2  # one AdamW step taken
    assert torch.equal(torch.get_rng_state(), saved_rng)


def test_restore_into_another_model_names_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    _save(path, 2)
    payload = {**ckpt.read_checkpoint(path), "path": str(path)}
    other = torch.nn.Linear(4, 5)
    optimizer, scheduler = build_optimizer(other, TrainConfig())
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(repr(str(path)))} does not "
                                         r"match its config \(RuntimeError: "):
        restore(payload, other, optimizer, scheduler, sharded=False)


@pytest.mark.parametrize("failure", ["enospc", "short_write"])
def test_disk_full_names_the_file_and_the_surviving_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """A full disk (simulated): ENOSPC, or torch.save's "unexpected pos" on a disk left with
    no space, is one OSError naming the file and the checkpoint that is left."""
    import errno
    import shutil

    path = tmp_path / "checkpoint.pt"
    _save(path, 1)
    before = path.read_bytes()

    def full_disk_save(obj: object, f: object) -> None:
        f.write(b"partial bytes")  # type: ignore[attr-defined]
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 13")

    monkeypatch.setattr(ckpt.torch, "save", full_disk_save)
    full = shutil._ntuple_diskusage(10**9, 10**9, 0)  # type: ignore[attr-defined]
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: full)
    with pytest.raises(OSError) as info:
        _save(path, 2)
    assert info.value.errno == errno.ENOSPC
    assert info.value.strerror == (f"no space left on the device writing '{path}'; the previous "
                                   f"checkpoint '{path}' is intact; free space and --resume")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    with pytest.raises(OSError) as info:
        _save(tmp_path / "other.pt", 1)
    assert info.value.strerror.endswith(  # no checkpoint: nothing to --resume
        f"no checkpoint was saved, so a training run removes the files it created in "
        f"'{tmp_path}'; free space and run the same command again")


def test_short_write_with_space_left_is_not_called_disk_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def short_save(obj: object, f: object) -> None:
        raise RuntimeError("unexpected pos 64 vs 13")

    monkeypatch.setattr(ckpt.torch, "save", short_save)
    with pytest.raises(RuntimeError, match="^unexpected pos 64 vs 13$"):  # plenty free here
        _save(tmp_path / "checkpoint.pt", 1)


def test_stale_temporaries_of_killed_saves_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    _save(path, 1)
    stale = [tmp_path / ".checkpoint.pt.abc123.tmp", tmp_path / ".meta.pt.x.tmp"]
    for p in stale:
        p.write_bytes(b"half a checkpoint")
    keep = tmp_path / ".other.tmp"
    keep.write_bytes(b"not ours")
    assert sorted(ckpt.remove_stale_temporaries(tmp_path)) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp", "checkpoint.pt"]
    assert ckpt.load_checkpoint(path)["step"] == 1


class _NotTensorData:
    """A pickled object that weights-only loading refuses."""


def test_corrupt_message_drops_the_weights_only_advice(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": ckpt.FORMAT, "payload": _NotTensorData()}, path)
    with pytest.raises(ValueError) as info:
        ckpt.load_checkpoint(path)
    message = str(info.value)
    assert message == (f"checkpoint '{path}' is corrupt or truncated (UnpicklingError: it holds "
                       "Python objects that a memfine checkpoint never holds)")
    assert "weights_only" not in message


def test_a_save_stopped_by_the_file_size_limit_is_one_line(tmp_path: Path) -> None:
    """``ulimit -f``: Python ignores SIGXFSZ, so torch.save's write stops short with "unexpected
    pos"; the error names the limit, the file and what is left, not torch's words."""
    import errno
    import resource

    from memfine.artifacts.atomic import atomic_save

    path = tmp_path / "checkpoint.pt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(OSError) as info:
            atomic_save({"w": torch.zeros(100_000)}, path)
        atomic_save({"w": torch.zeros(10)}, path)  # a small file fits
        with pytest.raises(OSError) as kept:
            atomic_save({"w": torch.zeros(100_000)}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG
    assert info.value.strerror == (
        f"the file-size limit (ulimit -f: 100,000 bytes) stopped writing '{path}'; no checkpoint "
        f"was saved, so a training run removes the files it created in '{tmp_path}'; raise the "
        f"limit (ulimit -f unlimited) and run the same command again")
    assert kept.value.strerror.endswith(f"the previous checkpoint '{path}' is intact; raise the "
                                        f"limit (ulimit -f unlimited) and --resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
