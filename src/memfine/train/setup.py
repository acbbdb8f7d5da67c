"""Setting up a training run: resume rules, data, model and optimizer, outputs.

Legend: B batch, Q sequence length, L MoE layers, E experts.

:func:`setup_run` builds a :class:`RunState` in steps (resolve the config against the checkpoint,
load the data, build model and optimizer, restore the checkpoint, open the outputs); the loop in
:mod:`memfine.train.loop` then updates the state's progress fields step by step.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfine.artifacts.checkpoint import (
    CHECKPOINT_NAME,
    SHARDED_NAME,
    LoRABaseError,
    find_checkpoint,
    read_checkpoint,
)
from memfine.artifacts.finite import check_finite_model
from memfine.artifacts.lora_base import BASE_ATTRIBUTE, keep_base_copy, load_base_, set_lora_base
from memfine.artifacts.restore import restore
from memfine.artifacts.weights import load_weights
from memfine.config import TrainConfig
from memfine.data import ByteCorpus, unigram_entropy, val_batches
from memfine.nn import MoETransformerLM
from memfine.nn.lora import apply_lora
from memfine.reports.memory_log import check_fits, num_parameters
from memfine.reports.metrics import MetricsLog
from memfine.reports.outputs import Outputs
from memfine.train.execution import step_forward
from memfine.train.optim import build_optimizer
from memfine.train.parallel import ParallelTraining

# Fields a resumed run may change; everything else must match the checkpoint.
RESUMABLE_FIELDS = ("max_steps", "eval_every", "save_every", "eval_batches", "log_every",
                    "sample_tokens", "device", "compile", "deterministic")


@dataclass(slots=True)
class RunState:
    """One call of :func:`memfine.train.train`: what setup built and the loop's progress.

    Attributes:
        config: the resolved run config (``lr_decay_steps`` set).
        out_dir: the run directory.
        parallel: the parallel hooks (:class:`memfine.train.parallel.SingleProcess` on one
            process).
        corpus: the byte corpus and its split.
        unigram: byte-unigram entropy of the validation split, nats/byte.
        device: where the model lives.
        model: the language model.
        optimizer: AdamW.
        scheduler: its LR schedule.
        start: completed steps when this call began (the checkpoint's step on resume).
        val_data: fixed validation batches, each ``(x_BQ, y_BQ)`` int64 on CPU.
        log: the ``metrics.jsonl`` (and TensorBoard) writer; None on ranks other than the main
            one.
        bar: the tqdm progress bar, or None.
        t_start: ``time.perf_counter()`` when the call began, seconds.
        step: completed optimizer steps so far.
        losses: cross-entropy of each step run by this call, nats/byte.
        val_loss: the latest validation loss, nats/byte (None before the first evaluation).
        consistent: False while an optimizer update is half applied (no checkpoint then).
        saved_step: the step of the last checkpoint this run saved or resumed from (None
            before any).
        run_time: seconds spent in this call's steps.
        log_time: seconds of the steps since the last ``metrics.jsonl`` line.
        log_steps: steps since the last ``metrics.jsonl`` line.
        load_log_LE: (L, E) int64 tokens per expert since the last metrics line, or None.
        load_eval_LE: (L, E) int64 tokens per expert since the last evaluation, or None.
        forward: the training step's forward: the model, or its ``torch.compile`` form with
            ``config.compile`` (:func:`memfine.train.execution.step_forward`).
    """

    config: TrainConfig
    out_dir: Path
    parallel: ParallelTraining
    corpus: ByteCorpus
    unigram: float
    device: torch.device
    model: MoETransformerLM
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    start: int
    val_data: list[tuple[torch.Tensor, torch.Tensor]]
    log: MetricsLog | None
    bar: Any
    t_start: float
    forward: Callable[..., Any]
    step: int = 0
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    consistent: bool = True
    saved_step: int | None = None
    run_time: float = 0.0
    log_time: float = 0.0
    log_steps: int = 0
    load_log_LE: torch.Tensor | None = None
    load_eval_LE: torch.Tensor | None = None

    @property
    def ckpt_path(self) -> Path:
        """``out_dir/checkpoint.dcp`` (sharded runs) or ``out_dir/checkpoint.pt``."""
        return self.out_dir / (SHARDED_NAME if self.parallel.sharded else CHECKPOINT_NAME)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, B·N·Q (N micro-batches of B sequences)."""
        return self.config.batch_size * self.config.grad_accum * self.config.seq_len

    def say(self, text: str) -> None:
        """Print on the main process (through the progress bar when there is one)."""
        if self.bar is not None:
            self.bar.write(text)
        elif self.parallel.is_main:
            print(text)


def setup_run(config: TrainConfig, out_dir: Path, *, resume: bool, outputs: Outputs,
              parallel: ParallelTraining, init_from: Path | None = None) -> RunState:
    """Resolve the config, load data, build model and optimizer, restore, open the outputs.

    Everything that can fail on the configuration (data, model, checkpoint) runs before the
    first file is written (``config.json``, then ``metrics.jsonl`` and the outputs).

    Args:
        config: the run as given.
        out_dir: the run directory (checked and locked by the caller).
        resume: continue the checkpoint in ``out_dir``.
        outputs: the optional outputs (progress bar, TensorBoard).
        parallel: the parallel hooks.
        init_from: a run directory whose checkpoint's weights start this run (fine-tuning).

    Raises:
        ValueError: on bad data, a missing/corrupt checkpoint, a config that does not match
            it, a checkpoint already at ``max_steps``, or ``config.lora`` on a fresh run
            without ``init_from``.
    """
    t_start = time.perf_counter()
    config, payload = resolve_config(config, out_dir, resume=resume)
    if config.lora is not None and not resume and init_from is None:
        raise ValueError("TrainConfig.lora needs init_from: LoRA fine-tunes adapters on the "
                         "frozen weights of a trained model (--init-from RUN)")
    if payload is not None and int(payload["step"]) >= config.max_steps:  # before the data line
        raise ValueError(f"the checkpoint in {out_dir} is already at step {payload['step']}; "
                         f"--max-steps {config.max_steps} leaves nothing to train (pass a larger "
                         f"--max-steps)")
    say = print if parallel.is_main else _silent  # one copy of each line under torchrun
    corpus, unigram = load_data(config, say=say)
    device = torch.device(config.device)
    # on resume the checkpoint holds every weight (a LoRA one: its kept base), not init_from
    model, optimizer, scheduler = build_model(config, parallel, device,
                                              init_from=None if resume else init_from,
                                              resume_from=payload)
    start = (restore(payload, model, optimizer, scheduler, sharded=parallel.sharded)
             if payload else 0)
    if payload:  # NaN/±inf weights (saved before the divergence checks, or damaged) would
        # diverge at the first step and call it the last good one; every rank checks its shards
        check_finite_model(model, str(payload["path"]), total=lambda n: int(
            parallel.sum(torch.tensor(float(n), device=device)).item()))
    config_text = json.dumps(config.to_dict(), indent=2)  # written once all of it checked out
    say(f"config: {out_dir / 'config.json'} (every setting of the run)")
    if parallel.is_main:
        (out_dir / "config.json").write_text(config_text + "\n", encoding="utf-8")
        if "copy" not in getattr(model, BASE_ATTRIBUTE, {"copy": None}):
            keep_base_copy(model, out_dir)  # a LoRA run keeps the base bytes it trains on
        _announce(config, start=start, resume=resume, out_dir=out_dir, parallel=parallel)
    if config.lora is not None:
        say(lora_summary(model, config))
    val_data = val_batches(corpus.val_ids, num_batches=config.eval_batches,
                           batch_size=config.batch_size, seq_len=config.seq_len)
    log, bar = outputs.open(out_dir, config, start=start, resume=resume,
                            is_main=parallel.is_main)
    return RunState(config=config, out_dir=out_dir, parallel=parallel, corpus=corpus,
                    unigram=unigram, device=device, model=model, optimizer=optimizer,
                    scheduler=scheduler, start=start, val_data=val_data, log=log,
                    bar=bar, t_start=t_start, step=start,
                    saved_step=start if payload else None,
                    forward=step_forward(model, config, sharded=parallel.sharded))


def lora_summary(model: torch.nn.Module, config: TrainConfig) -> str:
    """One line: the adapters' rank, α and targets, and the trainable share of the parameters."""
    assert config.lora is not None, "called on a LoRA run"
    lora = config.lora
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    also = [n for n, on in (("routers", lora.train_router),
                            ("attention", lora.train_attention)) if on]
    return (f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on "
            f"{', '.join(lora.targets)} of every MoE layer{' + ' if also else ''}"
            f"{' + '.join(also)}; training {trained:,} of {total:,} parameters "
            f"({100 * trained / total:.2f}%), the rest frozen")


def _announce(config: TrainConfig, *, start: int, resume: bool, out_dir: Path,
              parallel: ParallelTraining) -> None:
    """Print the model size, threads, start step and the predicted memory (warning if over)."""
    n_params = num_parameters(config)
    print(f"model: {n_params:,} parameters; {torch.get_num_threads()} CPU thread(s); "
          f"{'resuming at' if resume else 'starting at'} step {start} of {config.max_steps}; "
          f"writing to {out_dir}")
    local_rows = parallel.shard_batch(torch.empty(config.batch_size, 0))[0].shape[0]
    local_tokens = local_rows * config.seq_len
    line, warning = check_fits(config, n_params, local_tokens, torch.device(config.device))
    print(line)
    if warning is not None:
        print(warning, file=sys.stderr)


def resolve_config(config: TrainConfig, out_dir: Path, *, resume: bool
                   ) -> tuple[TrainConfig, dict[str, Any] | None]:
    """Apply the resume rules and resolve ``lr_decay_steps``.

    Returns:
        The config to run and the payload of the newest checkpoint in ``out_dir``
        (:func:`memfine.artifacts.checkpoint.read_checkpoint`; None without ``resume``).

    Raises:
        ValueError: when the checkpoint is missing or corrupt, or ``config`` differs from the
            saved one outside :data:`RESUMABLE_FIELDS`.
    """
    payload = None
    if resume:
        ckpt_path = find_checkpoint(out_dir)
        payload = {**read_checkpoint(ckpt_path), "path": str(ckpt_path)}
        saved = TrainConfig.from_dict(payload["config"])
        if config.lr_decay_steps is None:
            config = dataclasses.replace(config, lr_decay_steps=saved.lr_decay_steps)
        changed = [n for n in config.differing_fields(saved) if n not in RESUMABLE_FIELDS]
        if changed:
            raise ValueError(f"cannot resume from {str(ckpt_path)!r} with a different {changed}; "
                             f"only {list(RESUMABLE_FIELDS)} may change on resume")
    return dataclasses.replace(config, lr_decay_steps=config.resolved_lr_decay_steps), payload


def _silent(*_: object) -> None:
    """Print nothing (a rank other than the main one)."""


def load_data(config: TrainConfig, say: Callable[[str], None] = print
              ) -> tuple[ByteCorpus, float]:
    """Load and split the corpus; ``say`` its sizes and the unigram baseline.

    Returns:
        The corpus and the byte-unigram entropy of its validation split, nats/byte.
    """
    corpus = ByteCorpus.load(config.data, val_fraction=config.val_fraction,
                             seq_len=config.seq_len)
    unigram = unigram_entropy(corpus.val_ids)
    say(f"data: {corpus.description}: {corpus.train_ids.numel():,} train bytes, "
          f"{corpus.val_ids.numel():,} validation bytes (unigram entropy {unigram:.4f} nats/byte)")
    return corpus, unigram


def build_model(config: TrainConfig, parallel: ParallelTraining, device: torch.device, *,
                init_from: Path | None = None, resume_from: dict[str, Any] | None = None
                ) -> tuple[
                    MoETransformerLM, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Seed, build the model on ``device`` in ``config.dtype``, prepare it, build the optimizer.

    With ``init_from`` the weights come from that run directory's checkpoint (its model config
    must equal ``config.model``), loaded into the whole model before the parallel hooks shard it.
    With ``config.lora`` every MoE layer then gets expert adapters (:func:`memfine.nn.lora.
    apply_lora`, drawn from the seeded generator) and the optimizer holds the trainable
    parameters only; the frozen ones get no gradient buffer. A sharded run resuming a LoRA
    checkpoint (``resume_from``, either form) loads its frozen base into the whole model here,
    before sharding; the adapters follow in :func:`memfine.artifacts.restore.restore`.

    Raises:
        ValueError: when ``init_from``'s checkpoint is missing, corrupt or of another model;
            :class:`memfine.artifacts.checkpoint.LoRABaseError` naming the checkpoint when the
            base of ``resume_from`` is gone or changed.
    """
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model = MoETransformerLM(config.model).to(device=device, dtype=getattr(torch, config.dtype))
    if init_from is not None:
        load_weights(model, config.model, init_from)
    if config.lora is not None:
        apply_lora(model, config.lora)
        if init_from is not None:  # the checkpoints then hold the adapters, not the base
            set_lora_base(model, init_from)
        if resume_from is not None and "base" in resume_from and parallel.sharded:
            try:
                load_base_(resume_from["base"], resume_from["config"], model,
                           where=Path(resume_from["path"]).parent)
            except LoRABaseError as err:
                raise LoRABaseError(f"checkpoint {resume_from['path']!r}: {err}") from err
    parallel.check(num_experts=config.model.moe.num_experts, batch_size=config.batch_size)
    parallel.prepare_model(model)
    optimizer, scheduler = build_optimizer(model, config)
    return model, optimizer, scheduler
