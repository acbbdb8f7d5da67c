"""What the checkpoint commands share: the run-directory and device flags, and loading.

``memfine generate``, ``eval`` and ``export`` read the checkpoint of a ``memfine train`` run
directory (``--out``); a wrong path or device is one line naming the flag.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import torch

from memfine.artifacts.checkpoint import CheckpointNotFoundError
from memfine.flags.table import Flag, NotGiven, value
from memfine.flags.threads import clamp_threads
from memfine.flags.values import check_device, path_flag
from memfine.inference.trained import Trained, load_trained

OUT_FLAG = Flag("--out", (), "run directory of memfine train (reads its checkpoint.pt, or a "
                "torchrun run's checkpoint.dcp/)", path_flag, default=NotGiven(text="required"))
DEVICE_FLAG = Flag("--device", (), "torch device: cpu or cuda[:i]", str,
                   default=NotGiven("cpu"))


def run_directory(args: argparse.Namespace, dest: str = "out") -> Path:
    """The run directory a checkpoint command reads (``--out DIR`` of ``memfine train``).

    Raises:
        ValueError: naming the flag when it is missing, names a file, or does not exist.
    """
    flag = "--" + dest.replace("_", "-")
    got = value(args, dest)
    if got is None:
        raise ValueError(f"{flag} is required: the run directory of memfine train")
    path = Path(got)
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise ValueError(f"{flag} {str(path)!r} {problem}; {flag} takes the run directory of "
                         f"memfine train (the directory holding checkpoint.pt)")
    return path


def load_run(args: argparse.Namespace) -> Trained:
    """The model of ``--out``'s checkpoint, on ``--device``.

    Raises:
        ValueError: naming the flag when ``--out`` is missing, a file or absent, or
            ``--device`` cannot run here; as :func:`load_run_directory` on the checkpoint.
    """
    out = run_directory(args)
    if "threads" in args:
        torch.set_num_threads(clamp_threads(value(args, "threads")))  # its own thread count
    return load_run_directory(out, device=check_device(value(args, "device")))


def load_run_directory(out: Path, device: str = "cpu", *, base: bool = True) -> Trained:
    """The model of the checkpoint in the run directory ``out`` (``--out``), on ``device``.

    ``base=False``: a LoRA run's trained tensors without its frozen base
    (:func:`memfine.inference.trained.load_trained`).

    Raises:
        ValueError: naming the path when the checkpoint is missing (with the ``memfine train``
            command that writes one) or corrupt.
    """
    try:
        return load_trained(out, device=device, base=base)
    except CheckpointNotFoundError as err:
        raise ValueError(f"--out: {err} (train into it first: memfine train --out "
                         f"{shlex.quote(str(out))})") from err
