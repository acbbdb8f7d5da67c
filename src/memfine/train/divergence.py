"""Divergence: a step whose loss, gradient norm, validation loss or weights are not finite.

The loop checks each step's training loss and gradient norm before the optimizer applies the
update (:func:`check_finite`), the validation loss after it, and the weights before every save
(:func:`check_finite_weights`). A non-finite value stops the run with :class:`DivergedError`:
no checkpoint is ever written from such a step, so the last one saved stays the last good one,
and a run that saved none removes the files it created
(:func:`memfine.artifacts.rundir.removed_on_failure`).
"""

from __future__ import annotations

import math

import torch

from memfine.artifacts.finite import nonfinite_count
from memfine.train.setup import RunState


class DivergedError(ValueError):
    """Training diverged (a ``ValueError``).

    Its message names the step, the quantity and what is left in the run directory.
    """


def check_finite(run: RunState, step: int, quantity: str, value: float) -> None:
    """Raise :class:`DivergedError` when ``value`` (``quantity`` of ``step``) is NaN or ±inf."""
    if not math.isfinite(value):
        raise DivergedError(diverged_message(run, step, f"{quantity} is {value}"))


def check_finite_weights(run: RunState) -> None:
    """Raise :class:`DivergedError` when a weight of ``run.model`` is NaN or ±inf.

    Called before each save (on every rank of a sharded run: each checks its shards and the
    counts are summed, a collective).
    """
    total, tensors, first = nonfinite_count(run.model, lambda n: int(
        run.parallel.sum(torch.tensor(float(n), device=run.device)).item()))
    if total:
        what = f"{total} of {tensors} weight tensors are not finite"
        raise DivergedError(diverged_message(run, run.step, what + (f" ({first}, ...)"
                                                                    if first else "")))


def diverged_message(run: RunState, step: int, what: str) -> str:
    """One line: the step, what is not finite, the checkpoint left (or none) and the advice."""
    if run.saved_step is not None:
        left = (f"no checkpoint is written from it; {run.ckpt_path} keeps step "
                f"{run.saved_step}, the last good one (continue from it with a new run: "
                f"--init-from {run.out_dir} into another --out)")
    else:
        left = ("no checkpoint was saved before it (see --save-every), so the files this run "
                "created are removed")
    return f"training diverged at step {step}: {what}; {left}; lower --lr or --grad-clip"
