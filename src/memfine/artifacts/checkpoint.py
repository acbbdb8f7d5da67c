"""Training checkpoints: written atomically, read back with clear errors.

Two forms, and every run loads both:

- one process: ``checkpoint.pt``, one ``torch.save`` file holding the model, optimizer and
  LR-scheduler state dicts, the RNG states, the number of completed steps and the
  :class:`TrainConfig` as a dict. It is written to a temporary file in the same directory and
  moved into place with :func:`os.replace`, so the file is always either the previous
  checkpoint or the new one, never a partial write. A LoRA run's model state holds only the
  trained parameters and the buffers, plus ``base`` (the frozen base's run directory,
  checkpoint and SHA-256; :mod:`memfine.artifacts.lora_base`), which loading reads and checks
  first.
- sharded (under torchrun): ``checkpoint.dcp/``, a torch.distributed.checkpoint (DCP) directory
  in which every rank writes its own shards of the model and optimizer states
  (``get_state_dict``; tensors under their single-process names and global shapes, so a run
  resumes at another mesh layout), plus ``meta.pt`` (step, config, scheduler, RNG states) from
  the main rank. It is written to a temporary directory; the main rank then renames the
  previous one to ``checkpoint.dcp.old``, the new one into place, and deletes the old one. A
  save killed at any point leaves a loadable checkpoint: ``checkpoint.dcp`` or, between the
  two renames, ``checkpoint.dcp.old``.

After a save of either form, the other form's files are deleted; :func:`find_checkpoint` takes
the newest of what is there. ``checkpoint.pt`` and ``meta.pt`` get the permissions of any file
the process creates (``0o666`` less the umask, e.g. 0644), not the temporary file's 0600.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
)

from memfine.artifacts.atomic import atomic_save

FORMAT = "memfine-checkpoint-v1"
CHECKPOINT_NAME = "checkpoint.pt"
SHARDED_NAME = "checkpoint.dcp"
BASE_COPY_NAME = "lora_base"  # a LoRA run's folder of its frozen base checkpoints
META_NAME = "meta.pt"
_KEYS = ("format", "step", "config", "model", "optimizer", "scheduler", "rng")
_META_KEYS = ("format", "step", "config", "scheduler", "rng")


class CheckpointNotFoundError(ValueError):
    """No checkpoint where one was looked for (a ``ValueError``; its message names the path).

    The message says what is missing and nothing about how to get one: that depends on the
    caller (``memfine train --resume``, ``--init-from``, ``memfine generate``, ...), which catches
    this class to add its own hint.
    """


class LoRABaseError(ValueError):
    """A LoRA checkpoint's frozen base run is gone, changed or does not fit (a ``ValueError``).

    Raised by :func:`memfine.artifacts.lora_base.load_base_`; loading names the LoRA checkpoint
    in front of its message instead of calling the checkpoint one that does not fit its config.
    """


def rng_state() -> dict[str, Any]:
    """The RNG states a training run depends on.

    Returns:
        ``{"torch": CPU generator state, "python": random's state, "cuda": [one uint8 state per
        CUDA device]}``; ``cuda`` only once this process has initialised CUDA (router jitter,
        dropout and sampling on a GPU draw from the CUDA generators, not the CPU one).
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states from :func:`rng_state`, the CUDA ones when saved and CUDA is here.

    CUDA device i gets the saved state of device i, for the devices both machines have. A
    checkpoint written on a GPU and resumed without CUDA restores the CPU and Python states only
    (the CUDA ones have no generator to go to); one without CUDA states leaves the CUDA
    generators as seeded.
    """
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        for device in range(min(len(cuda_states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda_states[device], device)


def save_checkpoint(path: str | os.PathLike[str], *, step: int, config: dict[str, Any],
                    model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Write a checkpoint atomically (temporary file in the same directory + ``os.replace``).

    Args:
        path: destination file.
        step: completed optimizer steps.
        config: ``TrainConfig.to_dict()``.
        model: its ``state_dict()`` is stored (parameters and buffers); for a LoRA model with a
            recorded base (:func:`memfine.artifacts.lora_base.set_lora_base`) without the
            frozen parameters, and the base's reference beside it.
        optimizer: its ``state_dict()`` is stored (AdamW moments and step counts).
        scheduler: its ``state_dict()`` is stored (LR schedule position).

    Side effects: on any failure the temporary file is removed and ``path`` is left untouched;
    the file gets the permissions ``0o666 & ~umask``, like the run's other files.
    """
    from memfine.artifacts.lora_base import BASE_ATTRIBUTE, trainable_state

    path = Path(path)
    base = getattr(model, BASE_ATTRIBUTE, None)  # a LoRA run: the frozen base is not repeated
    payload = {"format": FORMAT, "step": step, "config": config,
               "model": model.state_dict() if base is None else trainable_state(model),
               "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "rng": rng_state(), **({} if base is None else {"base": base})}
    atomic_save(payload, path)
    for stale in (path.parent / SHARDED_NAME, _old(path.parent / SHARDED_NAME)):
        shutil.rmtree(stale, ignore_errors=True)


def remove_stale_temporaries(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files of saves that were killed (``.checkpoint.pt.*.tmp``).

    Call it while holding the run directory's lock (no save of another process is under way).
    A killed :func:`atomic_save` leaves a file the size of a checkpoint; no checkpoint ever
    reads it.

    Returns:
        The paths removed.
    """
    removed = []
    for name in (CHECKPOINT_NAME, META_NAME):
        for stale in Path(out_dir).glob(f".{name}.*.tmp"):
            if stale.is_file():
                stale.unlink(missing_ok=True)
                removed.append(stale)
    return removed


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint written by :func:`save_checkpoint` (tensors on CPU).

    Returns:
        The payload dict (keys ``format, step, config, model, optimizer, scheduler, rng``, and
        ``path``: where it was read).

    Raises:
        CheckpointNotFoundError: naming the path, when the file is missing.
        ValueError: naming the path, when the file is truncated, corrupt, or not a memfine
            checkpoint.
    """
    return _read(Path(path), _KEYS)


def _read(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or truncated "
                         f"({_load_failure(err)})") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} is not a {FORMAT} file")
    missing = [k for k in keys if k not in payload]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {missing}")
    payload["path"] = str(path)
    return payload


def _load_failure(err: Exception) -> str:
    """torch.load's reason in one line, without its advice to retry with ``weights_only=False``.

    That advice would run arbitrary code from a file that is not a memfine checkpoint.
    """
    text = str(err).strip()
    if "weights_only" in text or "Weights only load failed" in text:
        return (f"{type(err).__name__}: it holds Python objects that a memfine checkpoint never "
                "holds")
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def save_sharded_checkpoint(path: str | os.PathLike[str], *, step: int, config: dict[str, Any],
                            model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LRScheduler, is_main: bool,
                            barrier: Callable[[], None]) -> None:
    """Write a DCP checkpoint directory atomically; a collective (call on every rank).

    Args:
        path: the destination directory (``out_dir/checkpoint.dcp``), on a file system every
            rank sees.
        step: completed optimizer steps.
        config: ``TrainConfig.to_dict()``.
        model: its shards are stored (``get_state_dict``: DTensor shards under the
            single-process names).
        optimizer: its shards are stored, keyed by parameter name.
        scheduler: its ``state_dict()`` goes to ``meta.pt``.
        is_main: this rank writes ``meta.pt`` and swaps the directories.
        barrier: waits for every rank.

    Side effects: every rank writes its shards into a temporary directory next to ``path``;
    after a barrier the main rank renames (see the module docstring) and deletes
    ``checkpoint.pt`` of the same run directory.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed before
    barrier()
    from memfine.artifacts.lora_base import BASE_ATTRIBUTE, trainable_state

    base = getattr(model, BASE_ATTRIBUTE, None)  # a LoRA run: the frozen base is not repeated
    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # without a process group DCP writes one process's shards
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state if base is None else trainable_state(model, model_state),
                  "optimizer": optim_state}, checkpoint_id=tmp)
    barrier()  # every shard is on disk
    if is_main:
        meta = {"format": FORMAT, "step": step, "config": config,
                "scheduler": scheduler.state_dict(), "rng": rng_state(),
                **({} if base is None else {"base": base})}
        atomic_save(meta, tmp / META_NAME)
        old = _old(path)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        (path.parent / CHECKPOINT_NAME).unlink(missing_ok=True)
    barrier()


def find_checkpoint(out_dir: str | os.PathLike[str]) -> Path:
    """The newest checkpoint of a run directory.

    Candidates: ``checkpoint.pt``, ``checkpoint.dcp`` and the ``checkpoint.dcp.old`` left by a
    save killed between its two renames.

    Raises:
        CheckpointNotFoundError: naming both paths when there is no checkpoint.
        ValueError: when ``out_dir`` is a file, or naming the path when one is corrupt.
    """
    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise ValueError(f"{str(out_dir)!r} is a file, not a run directory (give the directory "
                         f"memfine train wrote, the one holding {CHECKPOINT_NAME})")
    candidates = [p for p in (out_dir / CHECKPOINT_NAME, out_dir / SHARDED_NAME,
                              _old(out_dir / SHARDED_NAME))
                  if p.is_file() or (p / META_NAME).is_file()]
    if not candidates:
        raise CheckpointNotFoundError(f"no checkpoint at {str(out_dir / CHECKPOINT_NAME)!r} "
                                      f"or {str(out_dir / SHARDED_NAME)!r}")
    return max(candidates, key=lambda p: int(read_checkpoint(p)["step"]))


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The payload of a checkpoint file, or the ``meta.pt`` of a DCP directory.

    Returns:
        The payload; a DCP one has no ``model``/``optimizer`` but ``sharded_path`` (the
        directory, for :func:`memfine.artifacts.restore.load_states`).

    Raises:
        ValueError: as :func:`load_checkpoint`.
    """
    path = Path(path)
    if path.is_dir():
        return {**_read(path / META_NAME, _META_KEYS), "sharded_path": str(path),
                "path": str(path)}
    return load_checkpoint(path)
