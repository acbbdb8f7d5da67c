"""One optimizer step of the training loop (:func:`run_step`).

Legend: N micro-batches, B batch, Q sequence length, L MoE layers, E experts.

loss = cross-entropy + ``aux_loss_coef``·load-balancing loss + ``z_loss_coef``·z-loss +
``seq_aux_loss_coef``·sequence-wise balance loss (each averaged over layers). The steps that
write a ``metrics.jsonl`` line (:meth:`memfine.config.TrainConfig.logs_at`) run forward +
backward under the peak tracker (:func:`memfine.reports.memory_log.measured_peak`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from memfine.data import train_batch
from memfine.reports.memory_log import measured_peak, predicted_moe_layer_peak
from memfine.train.accumulation import MicroOut, micro_batch, routing_prepass
from memfine.train.divergence import check_finite
from memfine.train.setup import RunState


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one optimizer step measured (values combined over the ranks where stated).

    Attributes:
        step: completed steps after this one.
        train_loss: cross-entropy of the step, nats/byte (mean over micro-batches and ranks).
        lr: learning rate the step used.
        grad_norm: global gradient norm before clipping.
        load_balancing_loss: mean over layers, micro-batches and ranks (f of the whole step
            with the balancing loss on, else each micro-batch's own f).
        z_loss: router z-loss (mean over layers, micro-batches and ranks, as above).
        num_chunks: chunk count c per MoE layer.
        recompute: recompute mode per MoE layer (``none``, ``experts``, ``full``).
        tokens_per_expert_LE: (L, E) int64 on CPU, assignments per expert (sum over the ranks).
        seconds: wall time of the step, seconds.
        peak_bytes: this rank's peak live bytes of forward + backward above those alive before
            the step (measured; None on steps that write no metrics line).
        peak_bytes_predicted: the memory model's peak bytes of each MoE layer's forward +
            backward at the step's c (None where not measured or not modelled).
        dropped_pairs: (token, slot) pairs dropped by expert capacity per layer on this rank
            (None when dropless).
        block_rows: the fused path's rows per row block each MoE layer ran (a memory
            budget's choice; None for a layer no chunk policy planned).
    """

    step: int
    train_loss: float
    lr: float
    grad_norm: float
    load_balancing_loss: float
    z_loss: float
    num_chunks: list[int]
    tokens_per_expert_LE: torch.Tensor
    seconds: float
    peak_bytes: int | None = None
    peak_bytes_predicted: list[int | None] | None = None
    dropped_pairs: list[int] | None = None
    recompute: tuple[str, ...] = ()
    block_rows: tuple[int | None, ...] = ()


def run_step(run: RunState, step_index: int) -> StepRecord:
    """One optimizer step on the batch of ``step_index`` (0-based); updates ``run``'s progress.

    The step's batch of N·B sequences (N = ``grad_accum``) runs as N micro-batches of B, each
    loss divided by N, so the summed gradients are those of the whole batch; gradients are
    reduced over the ranks on the last micro-batch only. With N > 1 and the balancing loss on,
    a routing pre-pass first counts the step's expert selection, so every micro-batch's aux
    losses use the whole step's f (:mod:`memfine.train.accumulation`). Then clip, AdamW, LR
    schedule and the aux-loss-free bias update from the step's global expert counts.

    Raises:
        DivergedError: when the training loss or the gradient norm is not finite; the update
            is then not applied (:mod:`memfine.train.divergence`).
    """
    config, parallel = run.config, run.parallel
    t0 = time.perf_counter()
    N, B = config.grad_accum, config.batch_size
    x_NBQ, y_NBQ = train_batch(run.corpus.train_ids, batch_size=N * B, seq_len=config.seq_len,
                               seed=config.seed, step=step_index)
    run.optimizer.zero_grad(set_to_none=True)
    step_counts = routing_prepass(run, x_NBQ)  # the step's f (None unless it matters)
    outs: list[MicroOut] = []
    with measured_peak(run.device, config.logs_at(step_index + 1),
                       compiled=config.compile) as tracker:
        for m in range(N):
            parallel.set_gradient_sync(run.model, m == N - 1)
            outs.append(micro_batch(run, x_NBQ[m * B:(m + 1) * B], y_NBQ[m * B:(m + 1) * B],
                                    N, step_counts))
    # CE, LBL, z-loss: mean over the micro-batches, then over the ranks
    ce, lbl, z = parallel.mean(torch.stack([out[0] for out in outs]).mean(0)).tolist()
    check_finite(run, step_index + 1, "the training loss", ce)  # before any update
    grad_norm, lr = _update(run, step_index)
    dt = time.perf_counter() - t0
    run.run_time, run.log_time, run.log_steps = (run.run_time + dt, run.log_time + dt,
                                                 run.log_steps + 1)
    run.losses.append(ce)
    load_LE = _count_load(run, outs)
    num_chunks = outs[-1][2]
    local_tokens = parallel.shard_batch(x_NBQ[:B])[0].numel()  # one micro-batch on this rank
    return StepRecord(
        step=run.step, train_loss=ce, lr=lr, grad_norm=grad_norm, load_balancing_loss=lbl,
        z_loss=z, num_chunks=num_chunks, recompute=tuple(outs[-1][4]),
        block_rows=tuple(outs[-1][5]),
        tokens_per_expert_LE=load_LE, seconds=dt,
        dropped_pairs=None if config.model.moe.dropless
        else torch.tensor([out[3] for out in outs]).sum(0).tolist(),
        peak_bytes=None if tracker is None else tracker.peak_bytes,
        peak_bytes_predicted=None if tracker is None else [
            predicted_moe_layer_peak(config, local_tokens, c, r, block_rows=b)
            for c, r, b in zip(num_chunks, outs[-1][4], outs[-1][5], strict=True)])


def _update(run: RunState, step_index: int) -> tuple[float, float]:
    """Clip, AdamW step, LR schedule; returns (gradient norm before clipping, the step's LR).

    ``run.consistent`` is False while the update is half applied (no checkpoint then).

    Raises:
        DivergedError: when the gradient norm is not finite (before AdamW touches a weight).
    """
    config = run.config
    grad_norm = run.parallel.clip_grad_norm_(
        run.model.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf).item()
    check_finite(run, step_index + 1, "the gradient norm", grad_norm)  # the weights untouched
    lr = float(run.scheduler.get_last_lr()[0])  # a float LR: the stubs allow a tensor too
    run.consistent = False
    run.optimizer.step()
    run.scheduler.step()
    run.step, run.consistent = step_index + 1, True
    return grad_norm, lr


def _count_load(run: RunState, outs: list[MicroOut]) -> torch.Tensor:
    """The step's (L, E) tokens per expert over micro-batches and ranks; moves the expert bias.

    The aux-loss-free bias moves once per step, from the global counts of every micro-batch
    (not while LoRA keeps the routers frozen); the counts are added to the ones since the last
    metrics line and since the last evaluation.
    """
    load_LE = run.parallel.sum(torch.stack([out[1] for out in outs]).sum(0)).cpu()
    lora = run.config.lora
    if lora is None or lora.train_router:  # a frozen router keeps its selection bias too
        run.model.update_expert_bias(load_LE)
    run.load_log_LE = load_LE if run.load_log_LE is None else run.load_log_LE + load_LE
    run.load_eval_LE = load_LE if run.load_eval_LE is None else run.load_eval_LE + load_LE
    return load_LE
