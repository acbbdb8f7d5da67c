"""``memfine train``: train the small byte-level MoE language model on real text.

A thin front end over :class:`memfine.config.TrainConfig`: one flag per field. The values come
from ``--preset`` (or, with ``--resume``, from the checkpoint in ``--out``); flags given on the
command line override them. Flags come from one table (:mod:`memfine.cli._flags`), named after
the config fields they set; ``--moe-chunks``, ``--moe-memory-budget`` and ``--chunk-bins`` are
hidden aliases of ``--num-chunks``, ``--memory-budget`` and ``--bins``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, get_args

from memfine import config
from memfine.artifacts.checkpoint import (
    CheckpointNotFoundError,
    find_checkpoint,
    read_checkpoint,
)
from memfine.artifacts.rundir import check_run_dir
from memfine.cli._budget import check_memory_budget, flag_message
from memfine.cli._checkpoint import run_directory
from memfine.cli._flags import (
    THREADS_FLAG,
    Flag,
    NotGiven,
    add_flags,
    apply_config_file,
    byte_size,
    check_device,
    checked_threads,
    comma_ints,
    given,
    name_flag,
    typed_fields,
    value,
)
from memfine.config import TrainConfig
from memfine.schedule.policy import InfeasibleBudgetError
from memfine.train import DEFAULT_PRESET, PRESETS, preset, train
from memfine.train.setup import RESUMABLE_FIELDS


def _optional_float(text: str) -> float | None:
    try:
        return None if text.lower() == "none" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _autocast_dtype(text: str) -> str:
    return "bfloat16" if text == "bf16" else text


def _optional_int(text: str) -> int | None:
    try:
        return None if text.lower() == "none" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'none', got {text!r}") from None


_CONFIG_FLAGS = (
    Flag("--data", ("data",), "'pydoc' (Python's documentation topics), 'stdlib' (the "
         "standard library's .py sources) or a path to a text file or directory", str),
    Flag("--val-fraction", ("val_fraction",), "share of the corpus (its end) held out for "
         "validation", float),
    Flag("--seq-len", ("seq_len", "model.max_seq_len"), "context length Q in bytes (= tokens)"),
    Flag("--batch-size", ("batch_size",), "sequences per micro-batch B (over all ranks)"),
    Flag("--grad-accum", ("grad_accum",), "micro-batches per optimizer step N (the step's "
         "gradient is that of one batch of N*B sequences)"),
    Flag("--max-steps", ("max_steps",), "optimizer steps of the run"),
    Flag("--lr", ("lr",), "peak AdamW learning rate", float),
    Flag("--min-lr-ratio", ("min_lr_ratio",), "final LR as a fraction of --lr", float),
    Flag("--warmup-steps", ("warmup_steps",), "linear LR warm-up steps"),
    Flag("--lr-decay-steps", ("lr_decay_steps",), "step where the cosine decay ends; None: "
         "--max-steps (set it to stop early and --resume later on the same schedule)"),
    Flag("--weight-decay", ("weight_decay",), "AdamW weight decay of matrices", float),
    Flag("--grad-clip", ("grad_clip",), "max global gradient norm (0: no clipping)", float),
    Flag("--seed", ("seed",), "seed of initialisation, batch order and sample"),
    Flag("--eval-every", ("eval_every",), "validate (and checkpoint, unless --save-every is set) "
         "every N steps"),
    Flag("--save-every", ("save_every",), "write checkpoint.pt every N steps and at the last "
         "step; None: at each evaluation", _optional_int),
    Flag("--eval-batches", ("eval_batches",), "validation batches (fixed windows)"),
    Flag("--log-every", ("log_every",), "write a metrics.jsonl line every N steps"),
    Flag("--sample-tokens", ("sample_tokens",), "bytes of text generated at the end"),
    Flag("--dtype", ("dtype",), "dtype of the weights, activations and AdamW state: bfloat16 "
         "means bf16 weights throughout (no fp32 master copy; the router's selection bias stays "
         "fp32); bf16 is slow on CPUs without bf16 units",
         str, tuple(d for d in get_args(config.DType) if d != "float16")),
    Flag("--autocast", ("autocast",), "mixed precision: bf16 (= bfloat16) runs the forward "
         "under torch.autocast with fp32 master weights and bf16 compute; the router stays "
         "fp32", _autocast_dtype, get_args(config.AutocastDType)),
    Flag("--device", ("device",), "torch device: cpu or cuda[:i]", str),
    Flag("--hidden-size", ("model.moe.hidden_size",), "model width d"),
    Flag("--num-layers", ("model.num_layers",), "transformer blocks"),
    Flag("--num-heads", ("model.num_heads",), "attention heads (divide d)"),
    Flag("--num-experts", ("model.moe.num_experts",), "routed experts E per MoE layer"),
    Flag("--top-k", ("model.moe.top_k",), "experts per token k"),
    Flag("--intermediate-size", ("model.moe.intermediate_size",),
         "expert intermediate size n per GLU branch"),
    Flag("--activation", ("model.moe.activation",), "expert activation", str,
         get_args(config.Activation)),
    Flag("--score-func", ("model.moe.score_func",), "router scores", str,
         get_args(config.ScoreFunc)),
    Flag("--aux-loss-coef", ("model.moe.aux_loss_coef",), "load-balancing loss weight", float),
    Flag("--z-loss-coef", ("model.moe.z_loss_coef",), "router z-loss weight", float),
    Flag("--experts-impl", ("model.moe.experts_impl",), "expert computation", str,
         get_args(config.ExpertsImpl)),
    Flag("--gemm-backend", ("model.moe.gemm_backend",), "grouped GEMM backend", str,
         get_args(config.GemmBackend)),
    Flag("--index-builder", ("model.moe.index_builder",), "dispatch index builder", str,
         get_args(config.IndexBuilder)),
    Flag("--backward-block-bytes", ("model.moe.backward_block_bytes",), "byte target of one "
         "row block of the fused experts' streamed backward, e.g. 16MiB", byte_size()),
    Flag("--num-chunks", ("model.chunk.num_chunks",), "fixed token chunk count c per MoE "
         "layer (ignored with --memory-budget)", aliases=("--moe-chunks",)),
    Flag("--memory-budget", ("model.chunk.memory_budget_bytes",), "activation memory budget, "
         "e.g. 512MiB, of each MoE layer call (c chosen per step, MACT) or of the whole step "
         "(--budget-scope step); 'none' for a fixed c", byte_size("none"),
         aliases=("--moe-memory-budget",)),
    Flag("--budget-scope", ("model.chunk.budget_scope",), "what --memory-budget bounds: "
         "'layer' (each MoE layer's peak) or 'step' (the whole step's activation peak: per "
         "layer no recompute, chunked experts or full block recompute)", str,
         ("layer", "step")),
    Flag("--recompute", ("model.chunk.recompute",), "recompute mode of the MoE layers", str,
         get_args(config.Recompute)),
    Flag("--bins", ("model.chunk.bins",), "allowed chunk counts c, comma-separated",
         lambda text: list(comma_ints(text)), aliases=("--chunk-bins",)),
    Flag("--capacity-factor", ("model.moe.capacity_factor",), "expert capacity factor cf: "
         "each expert keeps at most min(T, max(min-capacity, ceil(cf·T·k/E))) tokens; 'none': "
         "dropless", _optional_float),
    Flag("--min-capacity", ("model.moe.min_capacity",), "lower bound of the expert capacity, "
         "tokens"),
    Flag("--drop-policy", ("model.moe.drop_policy",), "which tokens an over-full expert "
         "keeps: highest routing weights or earliest positions", str, get_args(config.DropPolicy)),
    Flag("--n-group", ("model.moe.n_group",), "expert groups of group-limited routing "
         "(DeepSeek-V3; 1: off)"),
    Flag("--topk-group", ("model.moe.topk_group",), "groups each token may use"),
    Flag("--routed-scaling-factor", ("model.moe.routed_scaling_factor",), "factor on the "
         "routing weights after renormalisation (DeepSeek-V3: 2.5)", float),
    Flag("--bias-update-rate", ("model.moe.bias_update_rate",), "gamma of aux-loss-free "
         "balancing: selection bias step per optimizer step (0: off)", float),
    Flag("--seq-aux-loss-coef", ("model.moe.seq_aux_loss_coef",), "weight of the "
         "sequence-wise balance loss (DeepSeek-V3)", float),
    Flag("--router-jitter-eps", ("model.moe.router_jitter_eps",), "router input jitter: "
         "multiply by U(1-eps, 1+eps) in training (0: off)", float),
    Flag("--num-shared-experts", ("model.moe.num_shared_experts",), "always-on shared "
         "experts per MoE layer"),
    Flag("--shared-intermediate-size", ("model.moe.shared_intermediate_size",), "n of one "
         "shared expert; 'none': the routed experts' n", _optional_int),
    Flag("--skew-hot-experts", ("model.moe.skew_hot_experts",), "experiment knob: experts "
         "0..N-1 favoured by the router's selection bias (0: off)"),
    Flag("--skew-bias", ("model.moe.skew_bias",), "experiment knob: selection bias of the hot "
         "experts (> 1 with N = k sends every token to them)", float),
)


_SWITCH_FLAGS = (
    Flag("--renormalize", ("model.moe.renormalize",), "renormalise the k router weights (off by "
         "default when k = 1)", action=argparse.BooleanOptionalAction),
    Flag("--shared-expert-gate", ("model.moe.shared_expert_gate",), "scale the shared experts' "
         "output by a per-token sigmoid gate (Qwen2-MoE)", action=argparse.BooleanOptionalAction),
    Flag("--compile", ("compile",), "run the training step under torch.compile (inductor); "
         "evaluation and sampling stay eager", action="store_true"),
    Flag("--allow-over-budget", ("model.chunk.allow_over_budget",), "use the largest chunk bin "
         "(with a warning) when none meets the memory budget, instead of failing",
         action="store_true"),
)
_RUN_FLAGS = (
    Flag("--preset", (), "starting configuration; other flags override it", str,
         sorted(PRESETS), default=NotGiven(DEFAULT_PRESET)),
    Flag("--out", (), "run directory: config.json, metrics.jsonl, checkpoint.pt, summary.json, "
         "sample.txt", Path, default=NotGiven(text="runs/<preset>")),
    Flag("--resume", (), "continue from the checkpoint in --out (its config is used; only "
         f"{', '.join(RESUMABLE_FIELDS)} may be changed by flags)", action="store_true",
         default=NotGiven(False)),
    Flag("--overwrite", (), "replace the run already in --out (without it, any run file there "
         "stops the run)", action="store_true", default=NotGiven(False)),
    Flag("--init-from", (), "fine-tune: start from the weights of the checkpoint in this run "
         "directory (its model; fresh optimizer and LR schedule; give the new --data)", Path,
         default=NotGiven(text="none")),
    Flag("--config", (), "TOML file of flag values (keys: flag names with underscores, e.g. "
         "max_steps = 400); flags given on the command line override it", Path,
         default=NotGiven(text="none")),
    Flag("--tensorboard", (), "also write the logged scalars to --out/tensorboard (needs the "
         "tensorboard package)", action="store_true", default=NotGiven(False)),
    Flag("--plot", (), "write chunks.png (chunk count, layer x step) and loss.png to --out",
         action="store_true", default=NotGiven(False)),
    Flag("--no-progress", (), "hide the progress bar", action="store_true",
         default=NotGiven(False)),
    THREADS_FLAG,
    Flag("--ep", (), "size of the mesh dim 'ep': experts sharded E/ep over it; launch with "
         "torchrun --nproc_per_node W, W = dp-shard x ep", default=NotGiven(1)),
    Flag("--dp-shard", (), "size of the mesh dim 'dp_shard' (FSDP2 shards the experts over it; "
         "dense parameters over all W ranks); default W / ep", default=NotGiven(text="W/ep")),
    Flag("--backend", (), "torch.distributed backend under torchrun", str, ("gloo", "nccl"),
         default=NotGiven(text="gloo on cpu, nccl on cuda")),
)
_SETTING_FLAGS = _CONFIG_FLAGS + _SWITCH_FLAGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine train`` flags (one per TrainConfig field, plus run options)."""
    add_flags(parser, _RUN_FLAGS + _SETTING_FLAGS,
              default_for=lambda flag: _preset_default(flag.paths[0]))


def _preset_default(path: str) -> NotGiven:
    """The presets' value of a config field, for ``--help`` (e.g. ``small: 128, tiny: 64``)."""
    values = {name: _get(preset(name).to_dict(), path) for name in PRESETS}
    values = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in values.items()}
    if len({repr(v) for v in values.values()}) == 1:
        return NotGiven(text=str(next(iter(values.values()))))
    return NotGiven(text=", ".join(f"{name}: {v}" for name, v in values.items()))


def _set(tree: dict[str, Any], path: str, new: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree[key]
    tree[leaf] = new


def _get(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        tree = tree[key]
    return tree


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    """Build the run's TrainConfig and output directory from parsed flags.

    Order: the preset (or, with ``--resume``, the checkpoint's config; with ``--init-from``, the
    preset with that checkpoint's model and ``seq_len``), then ``--config`` FILE, then the flags
    given.

    Raises:
        ValueError: one line naming the flag, the value and what is allowed, on an invalid
            value; ``--preset`` or ``--init-from`` with ``--resume``; a flag that may not change
            on resume.
    """
    if given(args, "config"):
        apply_config_file(args, value(args, "config"), _RUN_FLAGS + _SETTING_FLAGS)
    resume = bool(value(args, "resume"))
    name = value(args, "preset")
    out = Path(value(args, "out") or f"runs/{name}")
    if resume:
        for flag in ("preset", "init_from"):
            if given(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} does not apply with --resume: the "
                                 f"configuration comes from the checkpoint in {str(out)!r}")
        tree = _checkpoint_of("--out", out, "train without --resume first")["config"]
    else:
        tree = preset(name).to_dict()
        if given(args, "init_from"):
            source = _checkpoint_of("--init-from", run_directory(args, "init_from"),
                                    "--init-from takes the --out of a memfine train run that "
                                    "has saved a checkpoint")
            tree["model"] = source["config"]["model"]  # and its context length:
            tree["seq_len"] = source["config"]["seq_len"]
    _apply_flags(args, tree, resume=resume, out=out)
    if not given(args, "renormalize") and tree["model"]["moe"]["top_k"] == 1:
        tree["model"]["moe"]["renormalize"] = False
    try:
        return TrainConfig.from_dict(tree), out
    except ValueError as err:
        raise ValueError(name_flag(err, typed_fields(args, _SETTING_FLAGS))) from err


def _checkpoint_of(flag: str, run_dir: Path, hint: str) -> dict[str, Any]:
    """The newest checkpoint payload of ``run_dir``.

    Raises:
        ValueError: naming ``flag``; with ``hint`` when there is no checkpoint.
    """
    try:
        return read_checkpoint(find_checkpoint(run_dir))
    except CheckpointNotFoundError as err:
        raise ValueError(f"{flag}: {err} ({hint})") from err
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from err


def _apply_flags(args: argparse.Namespace, tree: dict[str, Any], *, resume: bool,
                 out: Path) -> None:
    for flag in _SETTING_FLAGS:
        if not given(args, flag.dest):
            continue
        new = getattr(args, flag.dest)
        for path in flag.paths:
            if resume and path not in RESUMABLE_FIELDS and _get(tree, path) != new:
                raise ValueError(f"{flag.name} cannot change on --resume (the checkpoint in "
                                 f"{str(out)!r} has {_get(tree, path)!r}, got {new!r})")
            _set(tree, path, new)


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
    check_memory_budget(config, world)
    check_run_dir(out, data=config.data, resume=resume, overwrite=overwrite)
    parallel = _parallel(args, config, world)
    finished = False
    try:
        result = train(config, out, resume=resume, overwrite=overwrite,
                       progress=not value(args, "no_progress"), plot=bool(value(args, "plot")),
                       tensorboard=bool(value(args, "tensorboard")),
                       init_from=value(args, "init_from"), parallel=parallel, threads=threads)
        finished = True
    except InfeasibleBudgetError as err:  # at run time (torchrun): name the flags
        raise ValueError(flag_message(err)) from None
    finally:
        if parallel is not None:
            parallel.close(barrier=finished)
    return 0 if result.stop_signal is None else 128 + result.stop_signal


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
