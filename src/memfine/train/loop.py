"""The training loop: AdamW, warm-up + cosine LR, clipping, aux losses, eval, checkpoints.

Legend: B batch, Q sequence length, L MoE layers, E experts.

One step: draw the step's batch (a pure function of seed and step), forward, loss =
cross-entropy + ``aux_loss_coef``·load-balancing loss + ``z_loss_coef``·z-loss +
``seq_aux_loss_coef``·sequence-wise balance loss (each averaged over layers), backward, clip,
AdamW, LR schedule, then the aux-loss-free bias update from the step's global expert counts.
Every ``log_every`` steps a ``metrics.jsonl`` line; every ``eval_every`` steps (and at the end)
validation on fixed windows and a checkpoint. The
first Ctrl-C finishes the current step, saves a checkpoint and returns; a second one aborts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfine._optional import require
from memfine.config import TrainConfig
from memfine.nn import MoETransformerLM
from memfine.train.checkpoint import (
    CHECKPOINT_NAME,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from memfine.train.data import ByteCorpus, decode, train_batch, unigram_entropy, val_batches
from memfine.train.metrics import (
    METRICS_NAME,
    MetricsLog,
    format_expert_load,
    load_max_over_mean,
    nats_to_bits,
    plot_run,
    report_final,
)

ADAM_BETAS = (0.9, 0.95)
SAMPLE_TEMPERATURE = 0.8
SAMPLE_PROMPT_BYTES = 48
# Fields a resumed run may change; everything else must match the checkpoint.
RESUMABLE_FIELDS = ("max_steps", "eval_every", "eval_batches", "log_every", "sample_tokens",
                    "device")


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
        interrupted: True when stopped by Ctrl-C (a checkpoint was saved).
    """

    step: int
    train_losses: tuple[float, ...]
    final_val_loss: float | None
    unigram_entropy: float
    tokens_per_s: float
    wall_s: float
    sample: str
    interrupted: bool


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """LR multiplier for 0-based ``step``: linear warm-up, cosine to ``min_ratio``, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> tuple[
        torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay on tensors with ≥ 2 dims only) and its warm-up + cosine schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=ADAM_BETAS)
    decay_steps = config.lr_decay_steps or max(config.max_steps, config.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, warmup_steps=config.warmup_steps, decay_steps=decay_steps,
        min_ratio=config.min_lr_ratio))
    return optimizer, scheduler


@torch.no_grad()
def evaluate(model: MoETransformerLM, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> float:
    """Mean cross-entropy over fixed batches, nats/byte."""
    model.eval()
    losses = [float(model(x.to(device), y.to(device)).loss) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


@contextmanager
def _graceful_sigint() -> Iterator[threading.Event]:
    """First SIGINT sets the yielded event (stop after this step); a second one aborts."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_resumable(config: TrainConfig, saved: TrainConfig, path: Path) -> None:
    changed = [f.name for f in dataclasses.fields(config) if f.name not in RESUMABLE_FIELDS
               and getattr(config, f.name) != getattr(saved, f.name)]
    if changed:
        raise ValueError(f"cannot resume from {str(path)!r} with a different {changed}; only "
                         f"{list(RESUMABLE_FIELDS)} may change on resume")


def _restore(payload: dict[str, Any], path: Path, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, scheduler: Any, parallel: Any = None) -> int:
    try:
        if parallel is None:
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
        else:  # full expert tensors, sliced for this rank (any saved EP size)
            parallel.load_states(model, optimizer, payload["model"], payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
    except (RuntimeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r} does not match its config "
                         f"({type(err).__name__}: {str(err).splitlines()[0]})") from err
    return int(payload["step"])


def train(config: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          progress: bool = True, plot: bool = False,
          on_step: Callable[[int], None] | None = None, parallel: Any = None,
          threads: int | None = None) -> TrainResult:
    """Train the byte-level MoE language model of ``config`` on its corpus.

    Args:
        config: the run; ``lr_decay_steps=None`` is resolved to ``max_steps`` first.
        out_dir: run directory for ``config.json``, ``metrics.jsonl``, ``checkpoint.pt``,
            ``summary.json`` and ``sample.txt`` (created if missing; files are replaced).
        resume: continue from ``out_dir/checkpoint.pt``; ``config`` must equal the saved one
            except for :data:`RESUMABLE_FIELDS`.
        progress: show a tqdm progress bar (loss, tokens/s).
        plot: write ``chunks.png`` and ``loss.png`` at the end.
        on_step: called with the number of completed steps after each step (a
            ``KeyboardInterrupt`` raised there is handled like Ctrl-C).
        parallel: expert parallelism under torchrun (``memfine.parallel.ExpertParallelTraining``,
            from ``memfine train --ep``): shards the experts and each global batch, reduces and
            clips gradients over the ranks; only its main rank writes files. None: one process.
        threads: CPU threads for torch during the run (restored afterwards); ``None`` keeps
            torch's setting. One thread is much faster than two on a CPU shared with other jobs.

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: on bad data, a missing/corrupt checkpoint or a config that does not match
            it, ``threads < 1``, or a non-finite training loss (divergence).
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(config, Path(out_dir), resume=resume, progress=progress, plot=plot,
                      on_step=on_step, parallel=parallel)
    finally:
        torch.set_num_threads(previous_threads)


def _train(config: TrainConfig, out_dir: Path, *, resume: bool, progress: bool, plot: bool,
           on_step: Callable[[int], None] | None, parallel: Any) -> TrainResult:
    t_start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / CHECKPOINT_NAME
    payload = load_checkpoint(ckpt_path) if resume else None
    if payload is not None:
        saved = TrainConfig.from_dict(payload["config"])
        if config.lr_decay_steps is None:
            config = dataclasses.replace(config, lr_decay_steps=saved.lr_decay_steps)
        _check_resumable(config, saved, ckpt_path)
    if config.lr_decay_steps is None:  # a run shorter than its warm-up never decays
        config = dataclasses.replace(
            config, lr_decay_steps=max(config.max_steps, config.warmup_steps, 1))
    config_text = json.dumps(config.to_dict(), indent=2)
    print(f"config:\n{config_text}")
    main = parallel is None or parallel.is_main
    if main:
        (out_dir / "config.json").write_text(config_text + "\n", encoding="utf-8")

    corpus = ByteCorpus.load(config.data, val_fraction=config.val_fraction,
                             seq_len=config.seq_len)
    unigram = unigram_entropy(corpus.val_ids)
    print(f"data: {corpus.description}: {corpus.train_ids.numel():,} train bytes, "
          f"{corpus.val_ids.numel():,} validation bytes (unigram entropy {unigram:.4f} nats/byte)")

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    model = MoETransformerLM(config.model).to(device=device, dtype=dtype)
    if parallel is not None:
        parallel.check(num_experts=config.model.moe.num_experts, batch_size=config.batch_size)
        parallel.prepare_model(model)
    optimizer, scheduler = build_optimizer(model, config)
    start = _restore(payload, ckpt_path, model, optimizer, scheduler, parallel) if payload else 0
    if resume and start >= config.max_steps:
        raise ValueError(f"the checkpoint in {out_dir} is already at step {start}; --max-steps "
                         f"{config.max_steps} leaves nothing to train (pass a larger --max-steps)")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; {torch.get_num_threads()} CPU thread(s); "
          f"{'resuming at' if resume else 'starting at'} step {start} of {config.max_steps}; "
          f"writing to {out_dir}")
    log = MetricsLog(out_dir / METRICS_NAME, keep_until_step=start if resume else None) \
        if main else None
    val_data = val_batches(corpus.val_ids, num_batches=config.eval_batches,
                           batch_size=config.batch_size, seq_len=config.seq_len)
    bar = require("tqdm").tqdm(total=config.max_steps, initial=start, unit="step",
                               dynamic_ncols=True, mininterval=0.5) if progress and main else None
    say = bar.write if bar is not None else print if main else lambda *_: None

    def checkpoint(step: int) -> None:
        states = (model, optimizer) if parallel is None else parallel.full_states(model, optimizer)
        if main:
            save_checkpoint(ckpt_path, step=step, config=config.to_dict(), model=states[0],
                            optimizer=states[1], scheduler=scheduler)

    moe = config.model.moe
    tokens_per_step = config.batch_size * config.seq_len
    losses: list[float] = []
    step, consistent, val_loss = start, True, None
    run_time = log_time = 0.0
    log_steps = 0
    load_log_LE = load_eval_LE = None
    try:
        with _graceful_sigint() as stop:
            for step_index in range(start, config.max_steps):
                t0 = time.perf_counter()
                x_BQ, y_BQ = train_batch(corpus.train_ids, batch_size=config.batch_size,
                                         seq_len=config.seq_len, seed=config.seed,
                                         step=step_index)
                if parallel is not None:
                    x_BQ, y_BQ = parallel.shard_batch(x_BQ, y_BQ)
                out = model(x_BQ.to(device), y_BQ.to(device))
                loss = (out.loss + moe.aux_loss_coef * out.load_balancing_loss
                        + moe.z_loss_coef * out.z_loss)
                if moe.seq_aux_loss_coef > 0:
                    loss = loss + moe.seq_aux_loss_coef * out.sequence_balance_loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                clip = torch.nn.utils.clip_grad_norm_
                if parallel is not None:
                    parallel.reduce_gradients(model)
                    clip = parallel.clip_grad_norm_
                grad_norm = clip(
                    model.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf)
                lr = scheduler.get_last_lr()[0]
                consistent = False
                optimizer.step()
                scheduler.step()
                step, consistent = step_index + 1, True
                dt = time.perf_counter() - t0
                run_time, log_time, log_steps = run_time + dt, log_time + dt, log_steps + 1
                losses.append((out.loss if parallel is None else parallel.mean(out.loss)).item())
                if not math.isfinite(losses[-1]):
                    raise ValueError(f"training diverged at step {step}: train loss "
                                     f"{losses[-1]}; lower --lr or --grad-clip ({ckpt_path} "
                                     f"keeps the last evaluated step)")
                load_LE = out.tokens_per_expert
                load_LE = (load_LE if parallel is None else parallel.sum(load_LE)).cpu()
                model.update_expert_bias(load_LE)  # once per step, global counts
                load_log_LE = load_LE if load_log_LE is None else load_log_LE + load_LE
                load_eval_LE = load_LE if load_eval_LE is None else load_eval_LE + load_LE
                is_eval = step % config.eval_every == 0 or step == config.max_steps
                if is_eval:
                    val_loss = evaluate(model, val_data, device)
                    say(f"step {step}: train {losses[-1]:.4f}, validation {val_loss:.4f} "
                        f"nats/byte ({nats_to_bits(val_loss):.3f} bits/byte); expert load:\n"
                        f"{format_expert_load(load_eval_LE)}")
                    load_eval_LE = None
                    checkpoint(step)
                if step % config.log_every == 0 or is_eval:
                    record = {
                        "step": step, "train_loss": losses[-1], "lr": lr,
                        "tokens_per_s": log_steps * tokens_per_step / log_time,
                        "load_balancing_loss": out.load_balancing_loss.item(),
                        "z_loss": out.z_loss.item(), "grad_norm": grad_norm.item(),
                        "num_chunks": [a.num_chunks for a in out.aux],
                        "tokens_per_expert": load_log_LE.tolist(),
                        "expert_load_max_over_mean": [load_max_over_mean(c)
                                                      for c in load_log_LE],
                    }
                    if is_eval:
                        record["val_loss"] = val_loss
                    if not moe.dropless:  # pairs dropped by capacity this step (this rank)
                        record["dropped_pairs"] = [int(a.dropped_pairs or 0) for a in out.aux]
                    if log is not None:
                        log.write(record)
                    log_time, log_steps, load_log_LE = 0.0, 0, None
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.3f}",
                                    tok_s=f"{tokens_per_step * len(losses) / run_time:,.0f}")
                if on_step is not None:
                    on_step(step)
                if stop.is_set():
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        if consistent:
            checkpoint(step)
            print(f"interrupted: checkpoint of step {step} saved to {ckpt_path}; "
                  f"continue with --resume --out {out_dir}")
        else:
            print(f"interrupted during an optimizer update; {ckpt_path} keeps the last "
                  f"evaluated step")
        return TrainResult(step=step, train_losses=tuple(losses), final_val_loss=None,
                           unigram_entropy=unigram, tokens_per_s=_rate(losses, tokens_per_step,
                                                                       run_time),
                           wall_s=time.perf_counter() - t_start, sample="", interrupted=True)
    if bar is not None:
        bar.close()
    if val_loss is None:  # resumed at (or past) max_steps: nothing ran
        val_loss = evaluate(model, val_data, device)
    sample = _sample(model, corpus, config, device)
    result = TrainResult(step=step, train_losses=tuple(losses), final_val_loss=val_loss,
                         unigram_entropy=unigram,
                         tokens_per_s=_rate(losses, tokens_per_step, run_time),
                         wall_s=time.perf_counter() - t_start, sample=sample, interrupted=False)
    if main:
        report_final(out_dir, step=result.step, val_loss=val_loss, unigram=unigram,
                     tokens_per_s=result.tokens_per_s, wall_s=result.wall_s, sample=sample,
                     temperature=SAMPLE_TEMPERATURE)
    if plot and main:
        print("plots: " + ", ".join(str(p) for p in plot_run(out_dir)))
    return result


def _rate(losses: list[float], tokens_per_step: int, seconds: float) -> float:
    return len(losses) * tokens_per_step / seconds if seconds > 0 else 0.0


def _sample(model: MoETransformerLM, corpus: ByteCorpus, config: TrainConfig,
            device: torch.device) -> str:
    """Generate ``sample_tokens`` bytes after a prompt from the validation split.

    The prompt is the split's first ``SAMPLE_PROMPT_BYTES`` bytes after its first newline (so it
    starts at a line), at most ``seq_len``.
    """
    if config.sample_tokens == 0:
        return ""
    val = corpus.val_ids
    newlines = (val[:SAMPLE_PROMPT_BYTES] == ord("\n")).nonzero()
    start = int(newlines[0]) + 1 if newlines.numel() else 0
    prompt_1Q = val[start:start + min(SAMPLE_PROMPT_BYTES, config.seq_len)][None].to(device)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    model.eval()
    ids = model.generate(prompt_1Q, config.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                         generator=gen)
    return decode(ids[0].cpu())
