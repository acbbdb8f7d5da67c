"""Training checkpoints: written atomically, read back with clear errors.

A checkpoint is one ``torch.save`` file holding the model, optimizer and LR-scheduler state dicts,
the RNG states, the number of completed steps and the :class:`TrainConfig` as a dict. It is written
to a temporary file in the same directory and moved into place with :func:`os.replace`, so the
file at ``path`` is always either the previous checkpoint or the new one, never a partial write.
Its permissions are those of any file the process creates (``0o666`` less the umask, e.g. 0644),
not the temporary file's 0600.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "memfine-checkpoint-v1"
CHECKPOINT_NAME = "checkpoint.pt"
_KEYS = ("format", "step", "config", "model", "optimizer", "scheduler", "rng")


def rng_state() -> dict[str, Any]:
    """The CPU RNG states a training run depends on (torch and Python ``random``)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states from :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(path: str | os.PathLike[str], *, step: int, config: dict[str, Any],
                    model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Write a checkpoint atomically (temporary file in the same directory + ``os.replace``).

    Args:
        path: destination file.
        step: completed optimizer steps.
        config: ``TrainConfig.to_dict()``.
        model: its ``state_dict()`` is stored (parameters and buffers).
        optimizer: its ``state_dict()`` is stored (AdamW moments and step counts).
        scheduler: its ``state_dict()`` is stored (LR schedule position).

    Side effects: on any failure the temporary file is removed and ``path`` is left untouched;
    the file gets the permissions ``0o666 & ~umask``, like the run's other files.
    """
    path = Path(path)
    payload = {"format": FORMAT, "step": step, "config": config,
               "model": model.state_dict(), "optimizer": optimizer.state_dict(),
               "scheduler": scheduler.state_dict(), "rng": rng_state()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_mode() -> int:
    """Permissions of a newly created file: ``0o666`` less the process's umask (e.g. 0o644)."""
    mask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(mask)
    return 0o666 & ~mask


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint written by :func:`save_checkpoint` (tensors on CPU).

    Returns:
        The payload dict (keys ``format, step, config, model, optimizer, scheduler, rng``).

    Raises:
        ValueError: naming the path, when the file is missing, truncated, corrupt, or not a
            memfine checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {str(path)!r} (train without --resume first)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or truncated "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                         ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} is not a {FORMAT} file")
    missing = [k for k in _KEYS if k not in payload]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {missing}")
    return payload
