"""What the training loop does between steps: validate, checkpoint, log, show progress.

Legend: L MoE layers, E experts.

A metrics line carries the step's measured peak bytes next to the memory model's prediction
(:mod:`memfine.reports.memory_log`); which steps validate, save and log: the ``*_at`` methods
of :class:`memfine.config.TrainConfig`.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from memfine.artifacts.checkpoint import save_checkpoint, save_sharded_checkpoint
from memfine.reports.evaluation import evaluate
from memfine.reports.metrics import format_expert_load, load_max_over_mean, nats_to_bits
from memfine.train.divergence import check_finite, check_finite_weights
from memfine.train.setup import RunState
from memfine.train.step import StepRecord


def validate(run: RunState, record: StepRecord) -> None:
    """Validate; print the loss and the expert load since the last evaluation.

    Raises:
        DivergedError: when the validation loss is not finite.
    """
    run.val_loss = evaluate(run.model, run.val_data, run.device)
    check_finite(run, record.step, "the validation loss", run.val_loss)  # before any save
    assert run.load_eval_LE is not None, "a step ran since the last evaluation"
    run.say(f"step {record.step}: train {record.train_loss:.4f}, validation {run.val_loss:.4f} "
            f"nats/byte ({nats_to_bits(run.val_loss):.3f} bits/byte); expert load:\n"
            f"{format_expert_load(run.load_eval_LE)}")
    run.load_eval_LE = None


class _CheckpointArgs(TypedDict):
    """The keyword arguments both checkpoint writers take."""

    step: int
    config: dict[str, Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def save(run: RunState) -> None:
    """Save ``run.step``: ``checkpoint.pt`` on one process, else a DCP directory (every rank).

    Raises:
        DivergedError: when a weight is not finite; nothing is written, the last checkpoint
            stays.
    """
    check_finite_weights(run)
    parallel = run.parallel
    args: _CheckpointArgs = {"step": run.step, "config": run.config.to_dict(), "model": run.model,
            "optimizer": run.optimizer, "scheduler": run.scheduler}
    if parallel.sharded:
        save_sharded_checkpoint(run.ckpt_path, is_main=parallel.is_main,
                                barrier=parallel.barrier, **args)
    else:
        save_checkpoint(run.ckpt_path, **args)
    run.saved_step = run.step


def write_metrics(run: RunState, record: StepRecord, *, is_eval: bool) -> None:
    """Write one ``metrics.jsonl`` line (and TensorBoard scalars) for the steps since the last."""
    assert run.load_log_LE is not None, "a step ran since the last metrics line"
    line: dict[str, Any] = {
        "step": record.step, "train_loss": record.train_loss, "lr": record.lr,
        "tokens_per_s": run.log_steps * run.tokens_per_step / run.log_time,
        "load_balancing_loss": record.load_balancing_loss, "z_loss": record.z_loss,
        "grad_norm": record.grad_norm, "num_chunks": record.num_chunks,
        "recompute": list(record.recompute),
        "tokens_per_expert": run.load_log_LE.tolist(),
        "expert_load_max_over_mean": [load_max_over_mean(c) for c in run.load_log_LE],
        "peak_bytes": record.peak_bytes, "peak_bytes_predicted": record.peak_bytes_predicted,
    }
    if is_eval:
        line["val_loss"] = run.val_loss
    if record.dropped_pairs is not None:  # pairs dropped by capacity this step (this rank)
        line["dropped_pairs"] = record.dropped_pairs
    if run.config.model.chunk.memory_budget_bytes is not None and record.block_rows:
        line["block_rows"] = list(record.block_rows)  # rows per row block a budget ran
    if run.log is not None:
        run.log.write(line)
    run.log_time, run.log_steps, run.load_log_LE = 0.0, 0, None


def show_progress(run: RunState, record: StepRecord | None = None) -> None:
    """Advance the progress bar by one step, when there is one.

    The postfix shows the loss, tokens/s and, per layer, c with its recompute mode's initial
    (``c=4e,4e,1n,2f``).
    """
    if run.bar is not None:
        run.bar.update(1)
        layers = {} if record is None else {"c": ",".join(
            f"{c}{r[0]}" for c, r in zip(record.num_chunks, record.recompute, strict=False))}
        run.bar.set_postfix(loss=f"{run.losses[-1]:.3f}",
                            tok_s=f"{run.tokens_per_step * len(run.losses) / run.run_time:,.0f}",
                            **layers)


def close(run: RunState) -> None:
    """Close the progress bar and the TensorBoard writer."""
    if run.bar is not None:
        run.bar.close()
    if run.log is not None:
        run.log.close()
