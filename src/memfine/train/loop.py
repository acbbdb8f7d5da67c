"""The training loop: steps, then validation, checkpoints and metrics between them.

:func:`train` checks the outputs and the run directory (:mod:`memfine.artifacts.rundir`), takes
its lock, sets up (:mod:`memfine.train.setup`) and runs the loop; the first SIGINT or SIGTERM
finishes the current step, saves a checkpoint and returns (:mod:`memfine.runtime.stop`).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from memfine.artifacts.checkpoint import remove_stale_temporaries
from memfine.artifacts.rundir import check_run_dir, removed_on_failure, run_lock
from memfine.config import TrainConfig
from memfine.reports.evaluation import evaluate, sample_after_validation_prompt
from memfine.reports.metrics import plot_run, report_final
from memfine.reports.outputs import Outputs
from memfine.runtime.stop import graceful_stop
from memfine.train import events
from memfine.train.divergence import check_finite
from memfine.train.parallel import ParallelTraining, SingleProcess
from memfine.train.setup import RunState, setup_run
from memfine.train.step import run_step

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


def train(config: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          overwrite: bool = False, progress: bool | None = True, plot: bool = False,
          tensorboard: bool = False, tracker: str | None = None,
          init_from: str | Path | None = None,
          on_step: Callable[[int], None] | None = None,
          parallel: ParallelTraining | None = None, threads: int | None = None) -> TrainResult:
    """Train the byte-level MoE language model of ``config`` on its corpus.

    Args:
        config: the run; ``lr_decay_steps=None`` is resolved to ``max_steps`` first.
        out_dir: run directory for ``config.json``, ``metrics.jsonl``, ``checkpoint.pt``,
            ``summary.json`` and ``sample.txt`` (created if missing; see
            :func:`memfine.artifacts.rundir.check_run_dir` for what it refuses).
        resume: continue from ``out_dir/checkpoint.pt``; ``config`` must equal the saved one
            except for :data:`memfine.train.setup.RESUMABLE_FIELDS`.
        overwrite: replace the files of an earlier run in ``out_dir``.
        progress: show a tqdm progress bar (loss, tokens/s) when tqdm is installed; None:
            only when stderr is a terminal (its redraws would mix into a piped log).
        plot: write ``chunks.png`` and ``loss.png`` at the end (needs matplotlib).
        tensorboard: the same as ``tracker="tensorboard"`` (kept for older callers).
        tracker: also send the logged scalars to ``tensorboard`` (``out_dir/tensorboard``),
            ``trackio`` (its local store) or ``wandb`` (offline, ``out_dir/wandb``)
            (:mod:`memfine.reports.trackers`); ``metrics.jsonl`` is written either way.
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
            config that does not match it, or ``threads < 1``;
            :class:`memfine.train.divergence.DivergedError` (a ValueError) when a step's loss,
            gradient norm, validation loss or weights are not finite (no checkpoint is written
            from it). A run that fails before its first checkpoint removes the files it
            created.
        ImportError: naming the extra, before anything is written, when ``plot`` or the
            tracker lacks its package.
    """
    parallel = parallel if parallel is not None else SingleProcess()
    if tensorboard and tracker not in (None, "tensorboard"):
        raise ValueError(f"tensorboard=True asks for the tensorboard tracker, tracker is "
                         f"{tracker!r}: give one of them")
    tracker = "tensorboard" if tensorboard else tracker
    outputs = Outputs(progress=progress, tracker=tracker, plot=plot).check()
    out_dir, source = Path(out_dir), None if init_from is None else Path(init_from)
    with torch_threads(threads), contextlib.ExitStack() as directory:
        if parallel.is_main:  # the main rank checks, locks and writes the directory
            check_run_dir(out_dir, data=config.data, resume=resume, overwrite=overwrite)
            directory.enter_context(removed_on_failure(out_dir))
            out_dir.mkdir(parents=True, exist_ok=True)
            directory.enter_context(run_lock(out_dir))
            remove_stale_temporaries(out_dir)  # of saves killed earlier (under the lock)
        run = setup_run(config, out_dir, resume=resume, outputs=outputs, parallel=parallel,
                        init_from=source)
        return _loop(run, plot=plot, on_step=on_step)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` CPU threads (None: unchanged); restore torch's setting.

    Raises:
        ValueError: when ``threads`` is not an int >= 1.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _loop(run: RunState, *, plot: bool, on_step: Callable[[int], None] | None) -> TrainResult:
    """Run the steps from ``run.start`` to ``max_steps``; a stop signal checkpoints and returns."""
    config = run.config
    with graceful_stop() as stop:
        try:
            for step_index in range(run.start, config.max_steps):
                record = run_step(run, step_index)
                is_eval = config.evaluates_at(record.step)
                if is_eval:
                    events.validate(run, record)
                if config.saves_at(record.step):
                    events.save(run)
                if config.logs_at(record.step):
                    events.write_metrics(run, record, is_eval=is_eval)
                events.show_progress(run, record)
                if on_step is not None:
                    on_step(record.step)
                if stop.is_set():
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            return _interrupted(run, stop.signum or signal.SIGINT)
        except Exception:  # e.g. a diverged step: end the bar's line before the error's
            events.close(run)
            raise
    return _finish(run, plot=plot)


def _result(run: RunState, *, val_loss: float | None, sample: str,
            stop_signal: int | None = None) -> TrainResult:
    seconds = run.run_time
    rate = len(run.losses) * run.tokens_per_step / seconds if seconds > 0 else 0.0
    return TrainResult(step=run.step, train_losses=tuple(run.losses), final_val_loss=val_loss,
                       unigram_entropy=run.unigram, tokens_per_s=rate,
                       wall_s=time.perf_counter() - run.t_start, sample=sample,
                       interrupted=stop_signal is not None, stop_signal=stop_signal)


def _interrupted(run: RunState, signum: int) -> TrainResult:
    """After a stop signal: save the last completed step (unless an update was half applied)."""
    events.close(run)
    name = signal.Signals(signum).name
    if run.consistent:
        events.save(run)
        print(f"interrupted by {name}: checkpoint of step {run.step} saved to {run.ckpt_path}; "
              f"continue with --resume --out {run.out_dir}")
    else:
        print(f"interrupted by {name} during an optimizer update; {run.ckpt_path} keeps the last "
              f"saved step")
    return _result(run, val_loss=None, sample="", stop_signal=signum)


def _finish(run: RunState, *, plot: bool) -> TrainResult:
    """Final validation (if none ran), sample, ``summary.json``/``sample.txt``, plots.

    Raises:
        DivergedError: when the final validation loss is not finite (the last update
            diverged; no text can be sampled from the model).
    """
    events.close(run)
    val_loss = run.val_loss
    if val_loss is None:  # resumed at (or past) max_steps: nothing ran
        val_loss = evaluate(run.model, run.val_data, run.device)
    check_finite(run, run.step, "the final validation loss", val_loss)
    sample = sample_after_validation_prompt(run.model, run.corpus, run.config, run.device,
                                            temperature=SAMPLE_TEMPERATURE)
    result = _result(run, val_loss=val_loss, sample=sample)
    if run.parallel.is_main:
        headline = report_final(run.out_dir, step=result.step, val_loss=val_loss,
                                unigram=run.unigram, tokens_per_s=result.tokens_per_s,
                                wall_s=result.wall_s, sample=sample,
                                temperature=SAMPLE_TEMPERATURE)
        if plot:
            print("plots: " + ", ".join(str(p) for p in plot_run(run.out_dir)))
        print(f"done: {headline}; everything is in {run.out_dir}/: "
              f"{', '.join(_written(run.out_dir, result.step))}")
    return result


def _written(out_dir: Path, step: int) -> list[str]:
    """The run files in ``out_dir``, folders marked with a slash (no lock, no temporaries).

    A ``memfine export`` file (``*.safetensors``) written at an earlier step than ``step`` (a
    resumed run) says so: ``adapters.safetensors (exported at step 3, not step 6: export again)``.
    """
    return [p.name + ("/" if p.is_dir() else _older_export(p, step))
            for p in sorted(out_dir.iterdir()) if not p.name.startswith(".")]


def _older_export(path: Path, step: int) -> str:
    """`` (exported at step s, not step N: export again)`` for an older export, else ''."""
    if path.suffix != ".safetensors":
        return ""
    try:  # the step memfine export wrote into the header's metadata
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            exported = int((f.metadata() or {}).get("step", step))
    except Exception:  # noqa: BLE001 (not safetensors, or not memfine's: listed as it is)
        return ""
    return f" (exported at step {exported}, not step {step}: export again)" \
        if exported < step else ""
