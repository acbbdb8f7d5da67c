"""``memfine train``: train the small byte-level MoE language model on real text.

A thin front end over :class:`memfine.config.TrainConfig`: one flag per field, from one table
(:mod:`memfine.cli._train_flags`), resolved against the preset, the checkpoint of ``--resume``
or ``--init-from``, and ``--config`` FILE by :mod:`memfine.cli._train_config`. This module runs
the checks that need the machine (device, free memory, the process layout) and the training.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from memfine.artifacts.rundir import check_run_dir
from memfine.cli._budget import check_memory_budget, flag_message
from memfine.cli._flags import add_flags, check_device, checked_threads, given, value
from memfine.cli._train_config import preset_default, resolve_config
from memfine.cli._train_flags import RUN_FLAGS, SETTING_FLAGS
from memfine.config import TrainConfig
from memfine.schedule.policy import InfeasibleBudgetError
from memfine.train import train
from memfine.train.determinism import deterministic_mode

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
    threads = checked_threads(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _check_num_chunks(config, world)
    check_memory_budget(config, world)
    _check_memory_fits(config, world)
    check_run_dir(out, data=config.data, resume=resume, overwrite=overwrite)
    parallel = _parallel(args, config, world)
    finished = False
    try:
        with deterministic_mode(config.deterministic):
            result = train(config, out, resume=resume, overwrite=overwrite,
                           progress=not value(args, "no_progress"),
                           plot=bool(value(args, "plot")),
                           tensorboard=bool(value(args, "tensorboard")),
                           init_from=value(args, "init_from"), parallel=parallel,
                           threads=threads)
        finished = True
    except InfeasibleBudgetError as err:  # at run time (torchrun): name the flags
        raise ValueError(flag_message(err)) from None
    finally:
        if parallel is not None:
            parallel.close(barrier=finished)
    return 0 if result.stop_signal is None else 128 + result.stop_signal


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


def _check_memory_fits(config: TrainConfig, world: int) -> None:
    """Refuse a run whose predicted memory exceeds the device's free memory, before allocating.

    Raises:
        ValueError: naming the prediction, the free bytes and the flags that lower it.
    """
    import torch

    from memfine.artifacts.memory_log import available_bytes, num_parameters, predicted_run_bytes
    from memfine.units import format_bytes

    free = available_bytes(torch.device(config.device))
    if free is None or world > 1:  # under torchrun each rank holds a shard: checked per rank
        return
    params = num_parameters(config)
    predicted = predicted_run_bytes(config, params, _tokens_per_rank(config, world))
    if predicted > free:
        raise ValueError(f"the run needs about {format_bytes(predicted)} per step ({params:,} "
                         f"parameters with their gradients and AdamW state, and the MoE layers' "
                         f"activations), more than the {format_bytes(free)} free on "
                         f"{config.device}; lower --hidden-size, --num-layers, --num-experts, "
                         f"--intermediate-size, --batch-size or --seq-len, or set "
                         f"--memory-budget / --num-chunks")


def _parallel(args: argparse.Namespace, config: TrainConfig, world: int) -> Any:
    """The distributed engine under torchrun (``WORLD_SIZE`` > 1 or a mesh flag > 1), else None.

    ``world``: torchrun's ``WORLD_SIZE`` (1 on one process).

    Raises:
        ValueError: on a size < 1, a world size that is not dp_shard × ep, mesh flags
            without torchrun, or LoRA adapters on more than one process — before any process
            group exists.
    """
    ep = int(value(args, "ep"))
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    dp_shard = value(args, "dp_shard") if given(args, "dp_shard") else max(world // ep, 1)
    if world == 1 and ep == 1 and dp_shard == 1:
        return None
    if config.lora is not None:
        raise ValueError("--lora-rank runs on one process: LoRA fine-tuning is not built for "
                         "torchrun, --ep or --dp-shard yet")
    from memfine.parallel.mesh import check_expert_sharding, check_layout
    from memfine.parallel.training import DistributedTraining

    check_layout(world, int(dp_shard), ep)  # before any process group exists
    check_expert_sharding(config.model.moe.num_experts, ep)

    return DistributedTraining.from_environment(
        dp_shard=int(dp_shard), ep=ep, backend=value(args, "backend") or None,
        device=config.device)
