"""``memfine train``: train the small byte-level MoE language model on real text.

A thin front end over :class:`memfine.config.TrainConfig`: one flag per field. The values come
from ``--preset`` (or, with ``--resume``, from the checkpoint in ``--out``); flags given on the
command line override them. Flags not given keep a :class:`_Default` marker, which is how a given
flag is told from an untouched one.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch

from memfine.config import (
    Activation,
    DropPolicy,
    DType,
    ExpertsImpl,
    GemmBackend,
    IndexBuilder,
    Recompute,
    ScoreFunc,
    TrainConfig,
)
from memfine.train import DEFAULT_PRESET, PRESETS, load_checkpoint, preset, train
from memfine.train.checkpoint import CHECKPOINT_NAME
from memfine.train.loop import RESUMABLE_FIELDS
from memfine.units import parse_bytes


class _Default:
    """Default of a flag that was not given; ``--help`` prints ``text``."""

    __slots__ = ("text", "value")

    def __init__(self, value: Any = None, text: str | None = None) -> None:
        self.value, self.text = value, text if text is not None else str(value)

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class _Flag:
    """A flag that sets one or more TrainConfig fields (dotted paths)."""

    name: str
    paths: tuple[str, ...]
    help: str
    type: Any = int
    choices: Any = None


def _bins(text: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 1,2,4,8, got "
                                         f"{text!r}") from None


def _optional_float(text: str) -> float | None:
    try:
        return None if text.lower() == "none" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _optional_int(text: str) -> int | None:
    try:
        return None if text.lower() == "none" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'none', got {text!r}") from None


def _budget(text: str) -> int | None:
    try:
        return None if text.lower() == "none" else parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_CONFIG_FLAGS = (
    _Flag("--data", ("data",), "'pydoc' (Python's documentation topics), 'stdlib' (the "
          "standard library's .py sources) or a path to a text file or directory", str),
    _Flag("--val-fraction", ("val_fraction",), "share of the corpus (its end) held out for "
          "validation", float),
    _Flag("--seq-len", ("seq_len", "model.max_seq_len"), "context length Q in bytes (= tokens)"),
    _Flag("--batch-size", ("batch_size",), "sequences per step B"),
    _Flag("--max-steps", ("max_steps",), "optimizer steps of the run"),
    _Flag("--lr", ("lr",), "peak AdamW learning rate", float),
    _Flag("--min-lr-ratio", ("min_lr_ratio",), "final LR as a fraction of --lr", float),
    _Flag("--warmup-steps", ("warmup_steps",), "linear LR warm-up steps"),
    _Flag("--lr-decay-steps", ("lr_decay_steps",), "step where the cosine decay ends; None: "
          "--max-steps (set it to stop early and --resume later on the same schedule)"),
    _Flag("--weight-decay", ("weight_decay",), "AdamW weight decay of matrices", float),
    _Flag("--grad-clip", ("grad_clip",), "max global gradient norm (0: no clipping)", float),
    _Flag("--seed", ("seed",), "seed of initialisation, batch order and sample"),
    _Flag("--eval-every", ("eval_every",), "validate and checkpoint every N steps"),
    _Flag("--eval-batches", ("eval_batches",), "validation batches (fixed windows)"),
    _Flag("--log-every", ("log_every",), "write a metrics.jsonl line every N steps"),
    _Flag("--sample-tokens", ("sample_tokens",), "bytes of text generated at the end"),
    _Flag("--dtype", ("dtype",), "parameter dtype (bf16 is slow on CPUs without bf16 units)",
          str, tuple(d for d in get_args(DType) if d != "float16")),
    _Flag("--device", ("device",), "torch device: cpu or cuda[:i]", str),
    _Flag("--hidden-size", ("model.moe.hidden_size",), "model width d"),
    _Flag("--num-layers", ("model.num_layers",), "transformer blocks"),
    _Flag("--num-heads", ("model.num_heads",), "attention heads (divide d)"),
    _Flag("--num-experts", ("model.moe.num_experts",), "routed experts E per MoE layer"),
    _Flag("--top-k", ("model.moe.top_k",), "experts per token k"),
    _Flag("--intermediate-size", ("model.moe.intermediate_size",),
          "expert intermediate size n per GLU branch"),
    _Flag("--activation", ("model.moe.activation",), "expert activation", str,
          get_args(Activation)),
    _Flag("--score-func", ("model.moe.score_func",), "router scores", str, get_args(ScoreFunc)),
    _Flag("--aux-loss-coef", ("model.moe.aux_loss_coef",), "load-balancing loss weight", float),
    _Flag("--z-loss-coef", ("model.moe.z_loss_coef",), "router z-loss weight", float),
    _Flag("--experts-impl", ("model.moe.experts_impl",), "expert computation", str,
          get_args(ExpertsImpl)),
    _Flag("--gemm-backend", ("model.moe.gemm_backend",), "grouped GEMM backend", str,
          get_args(GemmBackend)),
    _Flag("--index-builder", ("model.moe.index_builder",), "dispatch index builder", str,
          get_args(IndexBuilder)),
    _Flag("--moe-chunks", ("model.chunk.num_chunks",), "fixed token chunk count c per MoE "
          "layer (ignored with --moe-memory-budget)"),
    _Flag("--moe-memory-budget", ("model.chunk.memory_budget_bytes",), "per-layer MoE "
          "activation budget, e.g. 512MiB; c is then chosen per step (MACT); 'none' for a fixed "
          "c", _budget),
    _Flag("--recompute", ("model.chunk.recompute",), "recompute mode of the MoE layers", str,
          get_args(Recompute)),
    _Flag("--chunk-bins", ("model.chunk.bins",), "allowed chunk counts, comma-separated", _bins),
    _Flag("--capacity-factor", ("model.moe.capacity_factor",), "expert capacity factor cf: "
          "each expert keeps at most min(T, max(min-capacity, ceil(cf·T·k/E))) tokens; 'none': "
          "dropless", _optional_float),
    _Flag("--min-capacity", ("model.moe.min_capacity",), "lower bound of the expert capacity, "
          "tokens"),
    _Flag("--drop-policy", ("model.moe.drop_policy",), "which tokens an over-full expert "
          "keeps: highest routing weights or earliest positions", str, get_args(DropPolicy)),
    _Flag("--n-group", ("model.moe.n_group",), "expert groups of group-limited routing "
          "(DeepSeek-V3; 1: off)"),
    _Flag("--topk-group", ("model.moe.topk_group",), "groups each token may use"),
    _Flag("--routed-scaling-factor", ("model.moe.routed_scaling_factor",), "factor on the "
          "routing weights after renormalisation (DeepSeek-V3: 2.5)", float),
    _Flag("--bias-update-rate", ("model.moe.bias_update_rate",), "gamma of aux-loss-free "
          "balancing: selection bias step per optimizer step (0: off)", float),
    _Flag("--seq-aux-loss-coef", ("model.moe.seq_aux_loss_coef",), "weight of the "
          "sequence-wise balance loss (DeepSeek-V3)", float),
    _Flag("--router-jitter-eps", ("model.moe.router_jitter_eps",), "router input jitter: "
          "multiply by U(1-eps, 1+eps) in training (0: off)", float),
    _Flag("--num-shared-experts", ("model.moe.num_shared_experts",), "always-on shared "
          "experts per MoE layer"),
    _Flag("--shared-intermediate-size", ("model.moe.shared_intermediate_size",), "n of one "
          "shared expert; 'none': the routed experts' n", _optional_int),
    _Flag("--skew-hot-experts", ("model.moe.skew_hot_experts",), "experiment knob: experts "
          "0..N-1 favoured by the router's selection bias (0: off)"),
    _Flag("--skew-bias", ("model.moe.skew_bias",), "experiment knob: selection bias of the hot "
          "experts (> 1 with N = k sends every token to them)", float),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine train`` flags (one per TrainConfig field, plus run options)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=_Default(DEFAULT_PRESET),
                        help="starting configuration; other flags override it")
    parser.add_argument("--out", type=Path, default=_Default(text="runs/<preset>"),
                        help="run directory: config.json, metrics.jsonl, checkpoint.pt, "
                             "summary.json, sample.txt")
    parser.add_argument("--resume", action="store_true", default=_Default(False),
                        help="continue from the checkpoint in --out (its config is used; only "
                             f"{', '.join(RESUMABLE_FIELDS)} may be changed by flags)")
    parser.add_argument("--overwrite", action="store_true", default=_Default(False),
                        help="replace the run already in --out (without it, an existing "
                             "checkpoint there stops the run)")
    parser.add_argument("--plot", action="store_true", default=_Default(False),
                        help="write chunks.png (chunk count, layer x step) and loss.png to --out")
    parser.add_argument("--no-progress", action="store_true", default=_Default(False),
                        help="hide the progress bar")
    parser.add_argument("--threads", type=int, default=_Default(1),
                        help="CPU threads for torch during the run; the presets' small matrices "
                             "gain little from more, and on a CPU shared with other jobs more "
                             "threads can be many times slower")
    parser.add_argument("--ep", type=int, default=_Default(1),
                        help="expert-parallel size e: shard the experts over e ranks; launch "
                             "with torchrun --nproc_per_node N (N a multiple of e; gloo on CPU, "
                             "nccl on CUDA)")
    for flag in _CONFIG_FLAGS:
        parser.add_argument(flag.name, type=flag.type, choices=flag.choices,
                            default=_preset_default(flag.paths[0]), help=flag.help)
    parser.add_argument("--renormalize", action=argparse.BooleanOptionalAction,
                        default=_preset_default("model.moe.renormalize"),
                        help="renormalise the k router weights (off by default when k = 1)")
    parser.add_argument("--shared-expert-gate", action=argparse.BooleanOptionalAction,
                        default=_preset_default("model.moe.shared_expert_gate"),
                        help="scale the shared experts' output by a per-token sigmoid gate "
                             "(Qwen2-MoE)")
    parser.add_argument("--allow-over-budget", action="store_true",
                        default=_preset_default("model.chunk.allow_over_budget"),
                        help="use the largest chunk bin (with a warning) when none meets the "
                             "memory budget, instead of failing")


def _preset_default(path: str) -> _Default:
    """The presets' value of a config field, for ``--help`` (e.g. ``small: 128, tiny: 64``)."""
    values = {name: _get(preset(name).to_dict(), path) for name in PRESETS}
    values = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in values.items()}
    if len({repr(v) for v in values.values()}) == 1:
        return _Default(text=str(next(iter(values.values()))))
    return _Default(text=", ".join(f"{name}: {value}" for name, value in values.items()))


def _given(args: argparse.Namespace, dest: str) -> bool:
    return not isinstance(getattr(args, dest), _Default)


def _value(args: argparse.Namespace, dest: str) -> Any:
    value = getattr(args, dest)
    return value.value if isinstance(value, _Default) else value


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree[key]
    tree[leaf] = value


def _get(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        tree = tree[key]
    return tree


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    """Build the run's TrainConfig and output directory from parsed flags.

    Raises:
        ValueError: on an invalid value (from the config's checks), ``--preset`` with
            ``--resume``, or a flag that may not change on resume.
    """
    resume = bool(_value(args, "resume"))
    name = _value(args, "preset")
    out = Path(_value(args, "out") or f"runs/{name}")
    if resume:
        if _given(args, "preset"):
            raise ValueError("--preset does not apply with --resume: the configuration comes "
                             f"from the checkpoint in {str(out)!r}")
        tree = load_checkpoint(out / CHECKPOINT_NAME)["config"]
    else:
        tree = preset(name).to_dict()
    flags = list(_CONFIG_FLAGS) + [_Flag("--renormalize", ("model.moe.renormalize",), ""),
                                   _Flag("--shared-expert-gate",
                                         ("model.moe.shared_expert_gate",), ""),
                                   _Flag("--allow-over-budget",
                                         ("model.chunk.allow_over_budget",), "")]
    for flag in flags:
        dest = flag.name[2:].replace("-", "_")
        if not _given(args, dest):
            continue
        value = getattr(args, dest)
        for path in flag.paths:
            if resume and path not in RESUMABLE_FIELDS and _get(tree, path) != value:
                raise ValueError(f"{flag.name} cannot change on --resume (the checkpoint in "
                                 f"{str(out)!r} has {_get(tree, path)!r}, got {value!r})")
            _set(tree, path, value)
    if not _given(args, "renormalize") and tree["model"]["moe"]["top_k"] == 1:
        tree["model"]["moe"]["renormalize"] = False
    return TrainConfig.from_dict(tree), out


def run(args: argparse.Namespace) -> int:
    """Run ``memfine train``; returns 0, or 130 when stopped by Ctrl-C (checkpoint saved)."""
    config, out = resolve_config(args)
    if (not _value(args, "resume") and not _value(args, "overwrite")
            and (out / CHECKPOINT_NAME).exists()):
        raise ValueError(f"{out} already holds a run ({CHECKPOINT_NAME}); pass --resume to "
                         f"continue it, --overwrite to replace it, or choose another --out")
    if str(config.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device} needs CUDA, and this torch has no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu")
    parallel, ep = None, int(_value(args, "ep"))
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    if ep > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from memfine.parallel.training import ExpertParallelTraining

        parallel = ExpertParallelTraining.from_environment(ep, device=config.device)
    finished = False
    try:
        result = train(config, out, resume=bool(_value(args, "resume")),
                       progress=not _value(args, "no_progress"), plot=bool(_value(args, "plot")),
                       parallel=parallel, threads=_value(args, "threads"))
        finished = True
    finally:
        if parallel is not None:
            parallel.close(barrier=finished)
    return 130 if result.interrupted else 0
