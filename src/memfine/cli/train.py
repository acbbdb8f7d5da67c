"""``memfine train``: train the small byte-level MoE language model on real text.

A thin front end over :class:`memfine.config.TrainConfig`: one flag per field, from one table
(:mod:`memfine.flags.train_flags`), resolved against the preset, the checkpoint of ``--resume``
or ``--init-from``, and ``--config`` FILE by :mod:`memfine.flags.train_config`. This module runs
the checks that need the machine (device, free memory, the process layout) and the training.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from memfine.artifacts.rundir import check_run_dir
from memfine.config import TrainConfig
from memfine.flags.budget import check_memory_budget
from memfine.flags.table import add_flags, given, value
from memfine.flags.threads import clamp_threads
from memfine.flags.train_config import preset_default, resolve_config
from memfine.flags.train_flags import RUN_FLAGS, SETTING_FLAGS
from memfine.flags.values import check_device
from memfine.reports.trackers import check_tracker
from memfine.runtime.determinism import deterministic_mode
from memfine.schedule.policy import InfeasibleBudgetError
from memfine.schedule.wording import budget_warnings_in_flags, flag_message
from memfine.train import train

__all__ = ["add_arguments", "resolve_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine train`` flags (one per TrainConfig field, plus run options)."""
    add_flags(parser, RUN_FLAGS + SETTING_FLAGS,
              default_for=lambda flag: preset_default(flag.paths[0]))


def run(args: argparse.Namespace) -> int:
    """Run ``memfine train``.

    Returns:
        0; when stopped by a signal, 128 + its number (130 for Ctrl-C, 143 for SIGTERM) after
        saving a checkpoint.
    """
    config, out = resolve_config(args)
    resume, overwrite = bool(value(args, "resume")), bool(value(args, "overwrite"))
    check_device(config.device)  # the flags first, then the directory
    threads = clamp_threads(value(args, "threads"))
    tracker = _tracker(args)
    if tracker is not None:
        try:
            check_tracker(tracker)  # a missing package: one line, before anything is written
        except ImportError as err:
            raise ValueError(f"--tracker {tracker}: {err}") from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _check_num_chunks(config, world)
    check_memory_budget(config, world)
    _check_memory_fits(config, world)
    check_run_dir(out, data=config.data, resume=resume, overwrite=overwrite,
                  check_lock=os.environ.get("RANK", "0") == "0")  # rank 0 takes the lock
    parallel = _parallel(args, config, world)
    finished = False
    try:
        with deterministic_mode(config.deterministic), budget_warnings_in_flags():
            result = train(config, out, resume=resume, overwrite=overwrite,
                           progress=False if value(args, "no_progress") else None,
                           plot=bool(value(args, "plot")),
                           tracker=tracker,
                           init_from=value(args, "init_from"), parallel=parallel,
                           threads=threads)
        finished = True
    except InfeasibleBudgetError as err:  # at run time (torchrun): name the flags
        raise ValueError(flag_message(err)) from None
    finally:
        if parallel is not None:
            parallel.close(barrier=finished)
    return 0 if result.stop_signal is None else 128 + result.stop_signal


def _tracker(args: argparse.Namespace) -> str | None:
    """``--tracker``, with the deprecated ``--tensorboard`` as ``--tracker tensorboard``.

    Raises:
        ValueError: ``--tensorboard`` with another ``--tracker``.
    """
    tracker = value(args, "tracker")
    if value(args, "tensorboard"):
        if tracker not in (None, "tensorboard"):
            raise ValueError(f"--tensorboard is --tracker tensorboard, which conflicts with "
                             f"--tracker {tracker}: give only --tracker")
        print("note: --tensorboard is deprecated; use --tracker tensorboard")
        tracker = "tensorboard"
    return tracker


def _tokens_per_rank(config: TrainConfig, world: int) -> int:
    """T, tokens one MoE layer sees per micro-batch on one process (the batch split over ranks)."""
    return max(config.batch_size // world, 1) * config.seq_len


def _check_num_chunks(config: TrainConfig, world: int) -> None:
    """Refuse a fixed chunk count above the tokens a layer sees: the extra chunks are empty.

    Raises:
        ValueError: naming ``--num-chunks`` and the most it may be.
    """
    chunk, tokens = config.model.chunk, _tokens_per_rank(config, world)
    if chunk.memory_budget_bytes is None and chunk.num_chunks > tokens:
        raise ValueError(f"--num-chunks must be at most the tokens of one MoE layer's call, "
                         f"{tokens} (--batch-size {config.batch_size} × --seq-len "
                         f"{config.seq_len}{f' over {world} ranks' if world > 1 else ''}), got "
                         f"{chunk.num_chunks}: each chunk holds at least one token")


def _rank_device(device: str, world: int) -> str:
    """The device this process computes on: ``cuda`` is ``cuda:LOCAL_RANK`` under torchrun."""
    if world > 1 and device == "cuda":
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def _check_memory_fits(config: TrainConfig, world: int) -> None:
    """Refuse a run whose predicted memory exceeds what this process has free, before allocating.

    One process: the whole model's parameters, gradients and AdamW state plus the MoE layers'
    activations at T = B·Q, against the device's free memory. Under torchrun every rank checks
    its own share before any process group exists: the parameters are sharded over the
    ``WORLD_SIZE`` ranks (FSDP2 and expert parallelism) but each rank first builds the whole
    model, so its prediction is the larger of the whole model's weights and its shard's static
    bytes plus the activations of its B/W rows. On CUDA each rank has its own device
    (``cuda:LOCAL_RANK``); on the CPU the ``LOCAL_WORLD_SIZE`` ranks of a host share its free
    memory, so each rank gets that share.

    Raises:
        ValueError: naming the prediction, the free bytes and the flags that lower it.
    """
    import torch

    from memfine.reports.memory_log import available_bytes, num_parameters, predicted_run_bytes
    from memfine.units import DTYPE_BYTES

    device = torch.device(_rank_device(config.device, world))
    free = available_bytes(device)
    if free is None:
        return
    where = f"free on {device}"
    tokens = _tokens_per_rank(config, world)
    # the step's N·B token windows (ids and targets, int64) are built before its first micro-batch
    data = config.grad_accum * tokens * 2 * 8
    lower = _lower_bound_bytes(config, world) + data
    if lower > free:  # arithmetic only: sizes too large to even build the model on the meta device
        raise ValueError(_too_large(config, lower, None, free, where))
    params = num_parameters(config)
    predicted = predicted_run_bytes(config, -(-params // world), tokens) + data
    if world > 1:
        predicted = max(predicted, params * DTYPE_BYTES[config.dtype])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if device.type == "cpu" and local > 1:
            free //= local
            where = f"share of each of the {local} ranks of this host's free memory"
        where += f" (rank {os.environ.get('RANK', '?')} of {world})"
    if predicted > free:
        raise ValueError(_too_large(config, predicted, params, free, where))


def _lower_bound_bytes(config: TrainConfig, world: int) -> int:
    """Bytes any run of ``config`` needs at least, from integer arithmetic alone.

    The routed experts' weights of every layer (sharded over the ranks) and each MoE layer's
    input kept for backward (:func:`memfine.memory.bounds.weights_and_inputs_lower_bound`).
    Checked first, so that sizes far beyond the machine are refused before the model is built,
    even on the meta device, and before the exact memory model replays a step of that size.
    """
    from memfine.memory.bounds import weights_and_inputs_lower_bound
    from memfine.units import DTYPE_BYTES

    moe = config.model.moe
    return weights_and_inputs_lower_bound(
        num_layers=config.model.num_layers, num_experts=moe.num_experts,
        hidden_size=moe.hidden_size, intermediate_size=moe.intermediate_size,
        tokens=_tokens_per_rank(config, world), dtype_bytes=DTYPE_BYTES[config.dtype],
        gated=moe.gated, shards=world)


def _too_large(config: TrainConfig, needed: int, params: int | None, free: int, where: str) -> str:
    """The message of a run that does not fit: what it needs, what is free, the flags to lower."""
    from memfine.units import format_bytes

    moe = config.model.moe
    shape = (f"--hidden-size {moe.hidden_size}, --num-layers {config.model.num_layers}, "
             f"--num-experts {moe.num_experts}, --intermediate-size {moe.intermediate_size}, "
             f"--batch-size {config.batch_size}, --grad-accum {config.grad_accum}, --seq-len "
             f"{config.seq_len}")
    what = (f"{params:,} parameters with their gradients and AdamW state, the MoE layers' "
            f"activations and the step's token windows" if params is not None
            else "at least: the routed experts' weights, each MoE layer's input and the step's "
                 "token windows")
    return (f"the run needs about {format_bytes(needed)} per step ({what}), more than the "
            f"{format_bytes(free)} {where}; lower --hidden-size, --num-layers, --num-experts, "
            f"--intermediate-size, --batch-size, --grad-accum or --seq-len (now {shape}), or set "
            f"--memory-budget / --num-chunks")


def _parallel(args: argparse.Namespace, config: TrainConfig, world: int) -> Any:
    """The distributed engine under torchrun (``WORLD_SIZE`` > 1 or a mesh flag > 1), else None.

    ``world``: torchrun's ``WORLD_SIZE`` (1 on one process).

    Raises:
        ValueError: on a size < 1, a world size that is not dp_shard × ep, or mesh flags
            without torchrun — before any process group exists.
    """
    ep = int(value(args, "ep"))
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    dp_shard = value(args, "dp_shard") if given(args, "dp_shard") else max(world // ep, 1)
    if world == 1 and ep == 1 and dp_shard == 1:
        return None
    from memfine.parallel.mesh import check_expert_sharding, check_layout
    from memfine.parallel.training import DistributedTraining

    check_layout(world, int(dp_shard), ep)  # before any process group exists
    check_expert_sharding(config.model.moe.num_experts, ep)

    return DistributedTraining.from_environment(
        dp_shard=int(dp_shard), ep=ep, backend=value(args, "backend") or None,
        device=config.device)
