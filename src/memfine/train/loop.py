"""The training loop: one optimizer step at a time, logging, evaluation and checkpoints.

Legend: B batch, Q sequence length, L MoE layers, E experts.

One step (:func:`_step`): draw the step's batch (a pure function of seed and step), forward,
loss = cross-entropy + ``aux_loss_coef``·load-balancing loss + ``z_loss_coef``·z-loss +
``seq_aux_loss_coef``·sequence-wise balance loss (each averaged over layers), backward, clip,
AdamW, LR schedule, then the aux-loss-free bias update from the step's global expert counts; it
returns a :class:`StepRecord`.
Every ``log_every`` steps a ``metrics.jsonl`` line (:func:`_log`) with the step's measured peak
bytes and the memory model's prediction (:mod:`memfine.runs.memory_log`); every ``eval_every``
steps (and at the end) validation on fixed windows (:func:`_evaluate`); a checkpoint at each
evaluation, or every ``save_every`` steps when set (:func:`_checkpoint`). The first SIGINT
(Ctrl-C) or SIGTERM finishes the current step, saves a checkpoint and returns; a second one
aborts (:mod:`memfine.train.stop`). Set-up (resume rules, data, model, optimizer) is in
:mod:`memfine.train.setup`; the run directory's rules in :mod:`memfine.runs.rundir`.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfine.config import TrainConfig
from memfine.data import train_batch
from memfine.runs.checkpoint import save_checkpoint, save_sharded_checkpoint
from memfine.runs.evaluation import evaluate, sample_after_validation_prompt
from memfine.runs.memory_log import measured_peak, predicted_moe_layer_peak
from memfine.runs.metrics import (
    format_expert_load,
    load_max_over_mean,
    nats_to_bits,
    plot_run,
    report_final,
)
from memfine.runs.outputs import Outputs
from memfine.runs.rundir import check_run_dir, run_lock
from memfine.train.accumulation import micro_batch, routing_prepass
from memfine.train.parallel import ParallelTraining, SingleProcess
from memfine.train.setup import RunState, setup_run
from memfine.train.stop import graceful_stop

SAMPLE_TEMPERATURE = 0.8


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What a call to :func:`train` did.

    Attributes:
        step: completed optimizer steps (including those before a resume).
        train_losses: cross-entropy of each step run by this call, nats/byte.
        final_val_loss: validation loss at the end, nats/byte (None when interrupted).
        unigram_entropy: byte-unigram entropy of the validation split, nats/byte.
        tokens_per_s: training tokens per second over this call's steps (0.0 without steps).
        wall_s: seconds spent in this call.
        sample: generated text ("" when skipped or interrupted).
        interrupted: True when stopped by a signal or ``KeyboardInterrupt`` (a checkpoint of the
            last completed step was saved).
        stop_signal: the signal that stopped the run (``signal.SIGINT`` for Ctrl-C and for a
            ``KeyboardInterrupt``, ``signal.SIGTERM``), or None when it finished.
    """

    step: int
    train_losses: tuple[float, ...]
    final_val_loss: float | None
    unigram_entropy: float
    tokens_per_s: float
    wall_s: float
    sample: str
    interrupted: bool
    stop_signal: int | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one optimizer step measured (values combined over the ranks where stated).

    Attributes:
        step: completed steps after this one.
        train_loss: cross-entropy of the step, nats/byte (mean over micro-batches and ranks).
        lr: learning rate the step used.
        grad_norm: global gradient norm before clipping.
        load_balancing_loss: load-balancing loss (mean over layers, then over micro-batches
            and ranks: with the balancing loss on, the whole step's value, f over every
            micro-batch and rank; with ``aux_loss_coef`` 0 each micro-batch's own f).
        z_loss: router z-loss (mean over layers, micro-batches and ranks, as above).
        num_chunks: chunk count c per MoE layer.
        tokens_per_expert_LE: (L, E) int64 on CPU, assignments per expert (sum over the ranks).
        seconds: wall time of the step, seconds.
        peak_bytes: this rank's peak live bytes of forward + backward above those alive before
            the step (measured; None on steps that write no metrics line).
        peak_bytes_predicted: the memory model's peak bytes of each MoE layer's forward +
            backward at the step's c (None where not measured or not modelled).
        dropped_pairs: (token, slot) pairs dropped by expert capacity per layer on this rank
            (None when dropless).
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


def train(config: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          overwrite: bool = False, progress: bool = True, plot: bool = False,
          tensorboard: bool = False, init_from: str | Path | None = None,
          on_step: Callable[[int], None] | None = None,
          parallel: ParallelTraining | None = None, threads: int | None = None) -> TrainResult:
    """Train the byte-level MoE language model of ``config`` on its corpus.

    Args:
        config: the run; ``lr_decay_steps=None`` is resolved to ``max_steps`` first.
        out_dir: run directory for ``config.json``, ``metrics.jsonl``, ``checkpoint.pt``,
            ``summary.json`` and ``sample.txt`` (created if missing; see
            :func:`memfine.runs.rundir.check_run_dir` for what it refuses).
        resume: continue from ``out_dir/checkpoint.pt``; ``config`` must equal the saved one
            except for :data:`memfine.train.setup.RESUMABLE_FIELDS`.
        overwrite: replace the files of an earlier run in ``out_dir``.
        progress: show a tqdm progress bar (loss, tokens/s) when tqdm is installed.
        plot: write ``chunks.png`` and ``loss.png`` at the end (needs matplotlib).
        tensorboard: also write the logged scalars to ``out_dir/tensorboard`` (needs
            tensorboard).
        init_from: a run directory whose checkpoint's weights start this run (fine-tuning on
            new data: fresh optimizer and schedule); its model config must equal
            ``config.model``.
        on_step: called with the number of completed steps after each step (a
            ``KeyboardInterrupt`` raised there is handled like Ctrl-C).
        parallel: the parallel hooks (:class:`memfine.train.parallel.ParallelTraining`), e.g.
            ``memfine.parallel.DistributedTraining`` from ``memfine train`` under torchrun:
            shards the model (experts over ``ep``, FSDP2 over the data dims) and each global
            batch, clips by the global norm; only its main rank writes files. None: one process.
        threads: CPU threads for torch during the run (restored afterwards); ``None`` keeps
            torch's setting. One thread is much faster than two on a CPU shared with other jobs.

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: on bad data, an ``out_dir`` holding another run's files (without
            ``resume``/``overwrite``) or used by a live run, a missing/corrupt checkpoint or a
            config that does not match it, ``threads < 1``, or a non-finite training loss.
        ImportError: naming the extra, before anything is written, when ``plot`` or
            ``tensorboard`` lacks its package.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    parallel = parallel if parallel is not None else SingleProcess()
    outputs = Outputs(progress=progress, tensorboard=tensorboard, plot=plot).check()
    out_dir = Path(out_dir)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if not parallel.is_main:
            run = setup_run(config, out_dir, resume=resume, outputs=outputs, parallel=parallel,
                            init_from=None if init_from is None else Path(init_from))
            return _loop(run, plot=plot, on_step=on_step)
        check_run_dir(out_dir, data=config.data, resume=resume, overwrite=overwrite)
        out_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(out_dir):
            run = setup_run(config, out_dir, resume=resume, outputs=outputs, parallel=parallel,
                            init_from=None if init_from is None else Path(init_from))
            return _loop(run, plot=plot, on_step=on_step)
    finally:
        torch.set_num_threads(previous_threads)


def _loop(run: RunState, *, plot: bool, on_step: Callable[[int], None] | None) -> TrainResult:
    """Run the steps from ``run.start`` to ``max_steps``; a stop signal checkpoints and returns."""
    config = run.config
    with graceful_stop() as stop:
        try:
            for step_index in range(run.start, config.max_steps):
                record = _step(run, step_index)
                is_eval = record.step % config.eval_every == 0 or record.step == config.max_steps
                if is_eval:
                    _evaluate(run, record)
                if _saves(config, record.step):
                    _checkpoint(run)
                if _logs(config, record.step):
                    _log(run, record, is_eval=is_eval)
                _show_progress(run)
                if on_step is not None:
                    on_step(record.step)
                if stop.is_set():
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            return _interrupted(run, stop.signum or signal.SIGINT)
    return _finish(run, plot=plot)


def _logs(config: TrainConfig, step: int) -> bool:
    """Whether completed step ``step`` writes a ``metrics.jsonl`` line."""
    return step % config.log_every == 0 or step % config.eval_every == 0 \
        or step == config.max_steps


def _saves(config: TrainConfig, step: int) -> bool:
    """Whether completed step ``step`` writes ``checkpoint.pt``."""
    every = config.save_every if config.save_every is not None else config.eval_every
    return step % every == 0 or step == config.max_steps


def _step(run: RunState, step_index: int) -> StepRecord:
    """One optimizer step on the batch of ``step_index`` (0-based); updates ``run``'s progress.

    The step's batch of N·B sequences (N = ``grad_accum``) runs as N micro-batches of B, each
    loss divided by N, so the summed gradients are those of the whole batch; gradients are
    reduced over the ranks on the last micro-batch only. With N > 1 and the balancing loss on,
    a routing pre-pass first counts the step's expert selection, so every micro-batch's aux
    losses use the whole step's f (:mod:`memfine.train.accumulation`).

    Raises:
        ValueError: when the training loss is not finite (divergence).
    """
    config, model, parallel = run.config, run.model, run.parallel
    t0 = time.perf_counter()
    N, B = config.grad_accum, config.batch_size
    x_NBQ, y_NBQ = train_batch(run.corpus.train_ids, batch_size=N * B, seq_len=config.seq_len,
                               seed=config.seed, step=step_index)
    run.optimizer.zero_grad(set_to_none=True)
    step_counts = routing_prepass(run, x_NBQ)  # the step's f (None unless it matters)
    outs = []
    with measured_peak(run.device, _logs(config, step_index + 1)) as tracker:
        for m in range(N):
            parallel.set_gradient_sync(model, m == N - 1)
            outs.append(micro_batch(run, x_NBQ[m * B:(m + 1) * B], y_NBQ[m * B:(m + 1) * B],
                                    N, step_counts))
    losses_N3 = torch.stack([out[0] for out in outs])
    grad_norm = parallel.clip_grad_norm_(
        model.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf)
    lr = run.scheduler.get_last_lr()[0]
    run.consistent = False
    run.optimizer.step()
    run.scheduler.step()
    run.step, run.consistent = step_index + 1, True
    dt = time.perf_counter() - t0
    run.run_time, run.log_time, run.log_steps = (run.run_time + dt, run.log_time + dt,
                                                 run.log_steps + 1)
    # CE, LBL, z-loss: mean over the micro-batches, then over the ranks
    ce, lbl, z = parallel.mean(losses_N3.mean(0)).tolist()
    run.losses.append(ce)
    if not math.isfinite(ce):
        _diverged(run)
    load_LE = parallel.sum(torch.stack([out[1] for out in outs]).sum(0)).cpu()
    model.update_expert_bias(load_LE)  # once per step, global counts of every micro-batch
    run.load_log_LE = load_LE if run.load_log_LE is None else run.load_log_LE + load_LE
    run.load_eval_LE = load_LE if run.load_eval_LE is None else run.load_eval_LE + load_LE
    num_chunks = outs[-1][2]
    local_tokens = parallel.shard_batch(x_NBQ[:B])[0].numel()  # one micro-batch on this rank
    return StepRecord(
        step=run.step, train_loss=ce, lr=lr, grad_norm=grad_norm.item(),
        load_balancing_loss=lbl, z_loss=z, num_chunks=num_chunks, tokens_per_expert_LE=load_LE,
        seconds=dt,
        dropped_pairs=None if config.model.moe.dropless
        else torch.tensor([out[3] for out in outs]).sum(0).tolist(),
        peak_bytes=None if tracker is None else tracker.peak_bytes,
        peak_bytes_predicted=None if tracker is None else [
            predicted_moe_layer_peak(config, local_tokens, c) for c in num_chunks])


def _diverged(run: RunState) -> None:
    """Raise the divergence error, naming the checkpoint to go back to when there is one."""
    saved = run.ckpt_path.exists()
    where = (f"{run.ckpt_path} keeps the last saved step" if saved
             else "no checkpoint was saved before it (see --save-every)")
    raise ValueError(f"training diverged at step {run.step}: train loss {run.losses[-1]}; lower "
                     f"--lr or --grad-clip ({where})")


def _evaluate(run: RunState, record: StepRecord) -> None:
    """Validate; print the loss and the expert load since the last evaluation."""
    run.val_loss = evaluate(run.model, run.val_data, run.device)
    assert run.load_eval_LE is not None, "a step ran since the last evaluation"
    run.say(f"step {record.step}: train {record.train_loss:.4f}, validation {run.val_loss:.4f} "
            f"nats/byte ({nats_to_bits(run.val_loss):.3f} bits/byte); expert load:\n"
            f"{format_expert_load(run.load_eval_LE)}")
    run.load_eval_LE = None


def _checkpoint(run: RunState) -> None:
    """Save ``run.step``: ``checkpoint.pt`` on one process, else a DCP directory (every rank)."""
    parallel = run.parallel
    args = {"step": run.step, "config": run.config.to_dict(), "model": run.model,
            "optimizer": run.optimizer, "scheduler": run.scheduler}
    if parallel.sharded:
        save_sharded_checkpoint(run.ckpt_path, is_main=parallel.is_main,
                                barrier=parallel.barrier, **args)
    else:
        save_checkpoint(run.ckpt_path, **args)


def _log(run: RunState, record: StepRecord, *, is_eval: bool) -> None:
    """Write one ``metrics.jsonl`` line (and TensorBoard scalars) for the steps since the last."""
    assert run.load_log_LE is not None, "a step ran since the last metrics line"
    line: dict[str, Any] = {
        "step": record.step, "train_loss": record.train_loss, "lr": record.lr,
        "tokens_per_s": run.log_steps * run.tokens_per_step / run.log_time,
        "load_balancing_loss": record.load_balancing_loss, "z_loss": record.z_loss,
        "grad_norm": record.grad_norm, "num_chunks": record.num_chunks,
        "tokens_per_expert": run.load_log_LE.tolist(),
        "expert_load_max_over_mean": [load_max_over_mean(c) for c in run.load_log_LE],
        "peak_bytes": record.peak_bytes, "peak_bytes_predicted": record.peak_bytes_predicted,
    }
    if is_eval:
        line["val_loss"] = run.val_loss
    if record.dropped_pairs is not None:  # pairs dropped by capacity this step (this rank)
        line["dropped_pairs"] = record.dropped_pairs
    if run.log is not None:
        run.log.write(line)
    if run.tensorboard is not None:
        for key in ("train_loss", "val_loss", "lr", "tokens_per_s", "load_balancing_loss",
                    "z_loss", "grad_norm", "peak_bytes"):
            if isinstance(line.get(key), (int, float)):
                run.tensorboard.add_scalar(key, line[key], record.step)
    run.log_time, run.log_steps, run.load_log_LE = 0.0, 0, None


def _show_progress(run: RunState) -> None:
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{run.losses[-1]:.3f}",
                            tok_s=f"{run.tokens_per_step * len(run.losses) / run.run_time:,.0f}")


def _result(run: RunState, *, val_loss: float | None, sample: str,
            stop_signal: int | None = None) -> TrainResult:
    seconds = run.run_time
    rate = len(run.losses) * run.tokens_per_step / seconds if seconds > 0 else 0.0
    return TrainResult(step=run.step, train_losses=tuple(run.losses), final_val_loss=val_loss,
                       unigram_entropy=run.unigram, tokens_per_s=rate,
                       wall_s=time.perf_counter() - run.t_start, sample=sample,
                       interrupted=stop_signal is not None, stop_signal=stop_signal)


def _close(run: RunState) -> None:
    if run.bar is not None:
        run.bar.close()
    if run.tensorboard is not None:
        run.tensorboard.close()


def _interrupted(run: RunState, signum: int) -> TrainResult:
    """After a stop signal: save the last completed step (unless an update was half applied)."""
    _close(run)
    name = signal.Signals(signum).name
    if run.consistent:
        _checkpoint(run)
        print(f"interrupted by {name}: checkpoint of step {run.step} saved to {run.ckpt_path}; "
              f"continue with --resume --out {run.out_dir}")
    else:
        print(f"interrupted by {name} during an optimizer update; {run.ckpt_path} keeps the last "
              f"saved step")
    return _result(run, val_loss=None, sample="", stop_signal=signum)


def _finish(run: RunState, *, plot: bool) -> TrainResult:
    """Final validation (if none ran), sample, ``summary.json``/``sample.txt``, plots."""
    _close(run)
    val_loss = run.val_loss
    if val_loss is None:  # resumed at (or past) max_steps: nothing ran
        val_loss = evaluate(run.model, run.val_data, run.device)
    sample = sample_after_validation_prompt(run.model, run.corpus, run.config, run.device,
                                            temperature=SAMPLE_TEMPERATURE)
    result = _result(run, val_loss=val_loss, sample=sample)
    if run.parallel.is_main:
        report_final(run.out_dir, step=result.step, val_loss=val_loss, unigram=run.unigram,
                     tokens_per_s=result.tokens_per_s, wall_s=result.wall_s, sample=sample,
                     temperature=SAMPLE_TEMPERATURE)
    if plot and run.parallel.is_main:
        print("plots: " + ", ".join(str(p) for p in plot_run(run.out_dir)))
    return result
