"""Experiment-tracking sinks of a training run: TensorBoard, trackio, Weights & Biases.

``metrics.jsonl`` stays the record (:class:`memfine.reports.metrics.MetricsLog`); a tracker
gets the numeric scalars of each line (:data:`memfine.reports.metrics.TRACKER_SCALARS`) at the
line's ``step``. Each tracker runs without a network or an account by default:

- ``tensorboard``: event files in ``out_dir/tensorboard`` (``torch.utils.tensorboard``); on
  resume the steps after the checkpoint are purged;
- ``trackio``: trackio's local store (a SQLite database under ``TRACKIO_DIR``, by default in the
  Hugging Face cache; ``trackio show`` opens the dashboard), project ``memfine``, run named after
  ``out_dir`` (``resume="allow"``: a resumed run, or another run into a directory of the same
  name, continues that trackio run);
- ``wandb``: offline mode (``WANDB_MODE=offline`` unless the environment sets another mode), the
  run's files under ``out_dir/wandb`` (``wandb sync`` uploads them later), project ``memfine``;
  a resumed run is a new wandb run whose steps start after the checkpoint's.

:func:`check_tracker` imports the package before the run writes anything: a missing package is
one ``ImportError`` line naming the extra (``pip install 'memfine[wandb]'``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from memfine._optional import require

TRACKERS = ("tensorboard", "trackio", "wandb")
PROJECT = "memfine"


class Tracker(Protocol):
    """A sink of scalars per step."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Record ``scalars`` (name → number) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and finish the run."""


def check_tracker(name: str) -> None:
    """Check that ``name`` is a tracker and its package imports (before anything is written).

    Raises:
        ValueError: ``name`` is not one of :data:`TRACKERS`.
        ImportError: its package is missing (one line naming the extra to install).
    """
    if name not in TRACKERS:
        raise ValueError(f"tracker must be one of {list(TRACKERS)}, got {name!r}")
    require(name)


class _TensorBoard:
    def __init__(self, out_dir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, number in scalars.items():
            self.writer.add_scalar(key, number, step)

    def close(self) -> None:
        self.writer.close()


class _Trackio:
    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        self.trackio = require("trackio")
        self.trackio.init(project=PROJECT, name=out_dir.resolve().name, config=config,
                          resume="allow")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.trackio.log(scalars, step=step)

    def close(self) -> None:
        self.trackio.finish()


class _Wandb:
    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        wandb = require("wandb")
        self.run = wandb.init(project=PROJECT, name=out_dir.resolve().name, dir=str(out_dir),
                              config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(name: str, out_dir: Path, *, config: dict[str, Any], start: int) -> Tracker:
    """Start tracker ``name`` for the run in ``out_dir``.

    Args:
        name: one of :data:`TRACKERS` (checked first by :func:`check_tracker`).
        out_dir: the run directory (TensorBoard's and wandb's files go under it).
        config: the run's configuration (a JSON-able dict), stored with the run by trackio
            and wandb.
        start: the step the run starts after (0, or the checkpoint's step on resume).

    Raises:
        ValueError, ImportError: as :func:`check_tracker`.
    """
    check_tracker(name)
    if name == "tensorboard":
        return _TensorBoard(out_dir, start)
    if name == "trackio":
        return _Trackio(out_dir, config)
    return _Wandb(out_dir, config)
