"""Gradient accumulation with the balancing loss over the whole step: the routing pre-pass.

``--grad-accum N`` runs a step's N·B sequences as N micro-batches, each loss divided by N, so
the summed gradients are those of one N·B batch. The load-balancing loss E·Σ_i f_i·P_i needs the
step's expert fractions f (counts over all N·B sequences and every rank) before the first
micro-batch's backward. f is a count and carries no gradient, so its value suffices: a no-grad
forward of each micro-batch first counts every MoE layer's selection
(:func:`step_selection_counts`), and each real micro-batch's layers then use the step's f and
divide P and the z-loss by the step's mean valid tokens per (rank, micro-batch) share, which
makes the mean over micro-batches and ranks the N·B batch's loss and gradient.

Cost: one forward per micro-batch without autograd, about a third of its forward + backward
arithmetic (docs/design.md §5), only when N > 1 and ``aux_loss_coef`` > 0. Both passes route
alike: same weights, inputs and autocast region, and the RNG (router jitter) is restored after
the pre-pass. Under ``--compile`` the pre-pass is a separately compiled no-grad graph whose
jitter noise and last-bit rounding may differ, so with jitter f is that of a routing close to,
not equal to, the real one.

Legend: L MoE layers, E experts, N micro-batches, B batch, Q sequence.
Reference: Switch Transformer load-balancing loss (docs/design.md §2); the global-batch aux
losses of :class:`memfine.nn.MoELayer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfine.config import TrainConfig
from memfine.train.execution import autocast_region
from memfine.train.setup import RunState

# What one micro-batch returns: (3,) [CE, LBL, z-loss], (L, E) counts, c per layer, drops,
# recompute mode per layer, row-block bytes a budget chose per layer.
MicroOut = tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[str], list[int | None]]


def needs_step_counts(config: TrainConfig) -> bool:
    """True when the step's f differs from a micro-batch's and moves the gradient.

    That is N = ``grad_accum`` > 1 micro-batches and a load-balancing loss in the training loss
    (``aux_loss_coef`` > 0). With the coefficient 0 the pre-pass is skipped (the logged
    ``load_balancing_loss`` then uses each micro-batch's own f).
    """
    return config.grad_accum > 1 and config.model.moe.aux_loss_coef > 0


def step_selection_counts(forward: Callable[..., Any],
                          micro_batches: Iterable[torch.Tensor],
                          region: Callable[[], contextlib.AbstractContextManager[Any]],
                          device: torch.device) -> torch.Tensor:
    """The routing pre-pass: every MoE layer's selection counts over the whole step.

    Args:
        forward: the training step's forward (the model or its compiled form); called as
            ``forward(input_ids_BQ)`` and returning a :class:`memfine.nn.LMOutput`.
        micro_batches: this rank's (B, Q) int64 input ids of each micro-batch, on ``device``.
        region: returns the context the real forward runs in (the autocast region), so both
            passes route in the same precision.
        device: the run's device (its RNG is restored afterwards along with the CPU's).

    Returns:
        (L, E + 1) int64: per layer, the router's selection per expert over every valid token
        of the step on every rank (before capacity drops), then the number of (rank,
        micro-batch) shares, N·W; pass it as ``step_selection_counts`` to each micro-batch's
        forward.

    Side effects: N forwards without autograd (each MoE layer's count all-reduce and, under
    expert parallelism, its all-to-alls); the CPU (and CUDA device) RNG state is left as it
    was before the call.
    """
    devices = [device] if device.type == "cuda" else []
    total: torch.Tensor | None = None
    # NOTE(memory): no_grad keeps nothing for backward; one micro-batch's forward transients.
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        for input_ids_BQ in micro_batches:
            with region():
                counts = forward(input_ids_BQ).selection_counts
            total = counts if total is None else total + counts
    if total is None:
        raise ValueError("step_selection_counts needs at least one micro-batch")
    return total


def routing_prepass(run: RunState, x_NBQ: torch.Tensor) -> torch.Tensor | None:
    """The step's (L, E + 1) selection counts for the training loop, or None when not needed.

    Args:
        run: the run (config, model or compiled forward, parallel hooks, device).
        x_NBQ: (N·B, Q) int64 input ids of the whole step's global batch (CPU).

    Returns:
        :func:`step_selection_counts` over this rank's rows of each of the N micro-batches when
        :func:`needs_step_counts`, else None.
    """
    config = run.config
    if not needs_step_counts(config):
        return None
    B = config.batch_size
    shards = (run.parallel.shard_batch(x_NBQ[m * B:(m + 1) * B])[0].to(run.device)
              for m in range(config.grad_accum))
    return step_selection_counts(run.forward, shards,
                                 lambda: autocast_region(run.device, config), run.device)


def micro_batch(run: RunState, x_BQ: torch.Tensor, y_BQ: torch.Tensor, num_micro: int,
                step_counts: torch.Tensor | None = None) -> MicroOut:
    """Forward and backward of one micro-batch (this rank's rows of it).

    Args:
        run: the run.
        x_BQ: (B, Q) int64 input ids of the micro-batch (every rank's rows; CPU).
        y_BQ: (B, Q) int64 targets.
        num_micro: N; the loss is divided by N so the step's gradients sum to the N·B batch's.
        step_counts: the step's (L, E + 1) selection counts from :func:`routing_prepass`, or
            None (each micro-batch's own f).

    Returns:
        (3,) detached [cross-entropy, load-balancing loss, z-loss] of this rank, the (L, E)
        tokens per expert of this rank, the chunk count c per layer, the pairs dropped by
        capacity per layer (0 when dropless), the recompute mode per layer and the row-block
        bytes a budget chose per layer (None: the config's).
    """
    moe = run.config.model.moe
    x_BQ, y_BQ = run.parallel.shard_batch(x_BQ, y_BQ)
    with autocast_region(run.device, run.config):
        out = run.forward(x_BQ.to(run.device), y_BQ.to(run.device),
                          step_selection_counts=step_counts)
        loss = (out.loss + moe.aux_loss_coef * out.load_balancing_loss
                + moe.z_loss_coef * out.z_loss)
        if moe.seq_aux_loss_coef > 0:
            loss = loss + moe.seq_aux_loss_coef * out.sequence_balance_loss
    (loss / num_micro).backward()
    losses = torch.stack([out.loss, out.load_balancing_loss, out.z_loss]).detach()
    dropped = [int(a.dropped_pairs or 0) for a in out.aux]
    return (losses, out.tokens_per_expert, [a.num_chunks for a in out.aux], dropped,
            [a.recompute for a in out.aux], [a.block_rows for a in out.aux])
