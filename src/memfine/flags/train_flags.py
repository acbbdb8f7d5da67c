"""The flag table of ``memfine train``: one flag per :class:`memfine.config.TrainConfig` field.

Each flag names the dotted config fields it sets (:class:`memfine.flags.table.Flag`). Groups:
:data:`CONFIG_FLAGS` (values), :data:`SWITCH_FLAGS` (on/off), :data:`LORA_FLAGS` (the LoRA
fine-tune, :class:`memfine.config.lora.LoRAConfig`) and :data:`RUN_FLAGS` (options of the run
that belong to no config: preset, run directory, resume, mesh). Old spellings are hidden aliases.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar, get_args

from memfine import config
from memfine.config.lora import LORA_TARGETS, LoRAConfig
from memfine.flags.table import Flag, NotGiven
from memfine.flags.threads import THREADS_FLAG
from memfine.flags.values import (
    byte_size,
    comma_ints,
    file_flag,
    finite_float,
    int64,
    path_flag,
    text_flag,
)
from memfine.reports.trackers import TRACKERS
from memfine.train import DEFAULT_PRESET, PRESETS
from memfine.train.setup import RESUMABLE_FIELDS

T = TypeVar("T")


def _none_or(parse: Callable[[str], T], what: str) -> Callable[[str], T | None]:
    """A flag type: ``none`` (any case) for None, else ``parse``'s value; ``what`` names it."""
    def convert(text: str) -> T | None:
        try:
            return None if text.lower() == "none" else parse(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {what} or 'none', got {text!r}"
                                             ) from None

    convert.__name__ = parse.__name__  # argparse's "invalid <name> value" if it ever shows
    return convert


def _autocast_dtype(text: str) -> str:
    return "bfloat16" if text == "bf16" else text


_optional_float = _none_or(finite_float, "a finite number")
_optional_int = _none_or(int64, "an int64 integer")


CONFIG_FLAGS = (
    Flag("--data", ("data",), "'pydoc' (Python's documentation topics), 'stdlib' (the "
         "standard library's .py sources) or a path to a text file or directory", text_flag),
    Flag("--val-fraction", ("val_fraction",), "share of the corpus (its end) held out for "
         "validation", finite_float),
    Flag("--seq-len", ("seq_len", "model.max_seq_len"), "context length Q in bytes (= tokens)"),
    Flag("--batch-size", ("batch_size",), "sequences per micro-batch B (over all ranks)"),
    Flag("--grad-accum", ("grad_accum",), "micro-batches per optimizer step N (the step's "
         "gradient is that of one batch of N*B sequences)"),
    Flag("--max-steps", ("max_steps",), "optimizer steps of the run"),
    Flag("--lr", ("lr",), "peak AdamW learning rate", finite_float),
    Flag("--min-lr-ratio", ("min_lr_ratio",), "final LR as a fraction of --lr", finite_float),
    Flag("--warmup-steps", ("warmup_steps",), "linear LR warm-up steps"),
    Flag("--lr-decay-steps", ("lr_decay_steps",), "step where the cosine decay ends; None: "
         "--max-steps (set it to stop early and --resume later on the same schedule)"),
    Flag("--weight-decay", ("weight_decay",), "AdamW weight decay of matrices", finite_float),
    Flag("--grad-clip", ("grad_clip",), "max global gradient norm (0: no clipping)", finite_float),
    Flag("--seed", ("seed",), "seed of initialisation, batch order and sample"),
    Flag("--eval-every", ("eval_every",), "validate (and checkpoint, unless --save-every is set) "
         "every N steps"),
    Flag("--save-every", ("save_every",), "write checkpoint.pt every N steps and at the last "
         "step; None: at each evaluation", _optional_int),
    Flag("--eval-batches", ("eval_batches",), "validation batches of 8 fixed windows each (the "
         "same windows for every --batch-size and layout)"),
    Flag("--log-every", ("log_every",), "write a metrics.jsonl line every N steps"),
    Flag("--sample-tokens", ("sample_tokens",), "bytes of text generated at the end"),
    Flag("--dtype", ("dtype",), "dtype of the weights, activations and AdamW state: bfloat16 "
         "means bf16 weights throughout (no fp32 master copy; the router's selection bias stays "
         "fp32); bf16 is slow on CPUs without bf16 units",
         str, tuple(d for d in get_args(config.DType) if d != "float16")),
    Flag("--autocast", ("autocast",), "mixed precision: bf16 (= bfloat16) runs the forward "
         "under torch.autocast with fp32 master weights and bf16 compute; the router stays "
         "fp32; default with --device cuda and fp32 weights", _autocast_dtype,
         get_args(config.AutocastDType)),
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
    Flag("--aux-loss-coef", ("model.moe.aux_loss_coef",), "load-balancing loss weight",
         finite_float),
    Flag("--z-loss-coef", ("model.moe.z_loss_coef",), "router z-loss weight", finite_float),
    Flag("--experts-impl", ("model.moe.experts_impl",), "expert computation", str,
         get_args(config.ExpertsImpl)),
    Flag("--gemm-backend", ("model.moe.gemm_backend",), "grouped GEMM backend", str,
         get_args(config.GemmBackend)),
    Flag("--index-builder", ("model.moe.index_builder",), "dispatch index builder", str,
         get_args(config.IndexBuilder)),
    Flag("--backward-block-bytes", ("model.moe.backward_block_bytes",), "byte target of one "
         "row block of the fused experts' streamed forward and backward, e.g. 16MiB; unset: "
         "the device's (16MiB on the CPU, 512MiB on CUDA), whose rows a layer-scope "
         "--memory-budget may halve twice before it adds chunks", byte_size()),
    Flag("--num-chunks", ("model.chunk.num_chunks",), "fixed token chunk count c per MoE "
         "layer; not with --memory-budget, under which MACT chooses c (giving both is an "
         "error)", aliases=("--moe-chunks",)),
    Flag("--memory-budget", ("model.chunk.memory_budget_bytes",), "activation memory budget, "
         "e.g. 512MiB, of each MoE layer call (c chosen per step, MACT) or of the whole step "
         "(--budget-scope step); 'none' for a fixed c (--num-chunks); not with --num-chunks",
         byte_size("none"), aliases=("--moe-memory-budget",)),
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
         "routing weights after renormalisation (DeepSeek-V3: 2.5)", finite_float),
    Flag("--bias-update-rate", ("model.moe.bias_update_rate",), "gamma of aux-loss-free "
         "balancing: selection bias step per optimizer step (0: off)", finite_float),
    Flag("--seq-aux-loss-coef", ("model.moe.seq_aux_loss_coef",), "weight of the "
         "sequence-wise balance loss (DeepSeek-V3)", finite_float),
    Flag("--router-jitter-eps", ("model.moe.router_jitter_eps",), "router input jitter: "
         "multiply by U(1-eps, 1+eps) in training (0: off)", finite_float),
    Flag("--num-shared-experts", ("model.moe.num_shared_experts",), "always-on shared "
         "experts per MoE layer"),
    Flag("--shared-intermediate-size", ("model.moe.shared_intermediate_size",), "n of one "
         "shared expert; 'none': the routed experts' n", _optional_int),
    Flag("--skew-hot-experts", ("model.moe.skew_hot_experts",), "experiment knob: experts "
         "0..N-1 favoured by the router's selection bias (0: off)"),
    Flag("--skew-bias", ("model.moe.skew_bias",), "experiment knob: selection bias of the hot "
         "experts (> 1 with N = k sends every token to them)", finite_float),
)


SWITCH_FLAGS = (
    Flag("--renormalize", ("model.moe.renormalize",), "renormalise the k router weights (off by "
         "default when k = 1)", action=argparse.BooleanOptionalAction),
    Flag("--shared-expert-gate", ("model.moe.shared_expert_gate",), "scale the shared experts' "
         "output by a per-token sigmoid gate (Qwen2-MoE)", action=argparse.BooleanOptionalAction),
    Flag("--compile", ("compile",), "run the training step under torch.compile (inductor); "
         "evaluation and sampling stay eager", action="store_true"),
    Flag("--deterministic", ("deterministic",), "torch's deterministic algorithms and "
         "CUBLAS_WORKSPACE_CONFIG=:4096:8: bitwise repeatable GPU runs, somewhat slower",
         action="store_true"),
    Flag("--allow-over-budget", ("model.chunk.allow_over_budget",), "use the largest chunk bin "
         "(with a warning) when none meets the memory budget, instead of failing",
         action="store_true"),
)


def _targets(text: str) -> list[str]:
    """``--lora-targets``: the names in LoRAConfig's order (``w_down,w_up`` is ``w_up,w_down``).

    Unknown names and duplicates stay, for the config's check to name them.

    Raises:
        argparse.ArgumentTypeError: on a value without a name (``''``, ``','``); argparse
            names the flag.
    """
    names = [item.strip() for item in str(text).split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a non-empty comma-separated subset of "
                                         f"{', '.join(LORA_TARGETS)}, got {text!r}")
    order = {name: i for i, name in enumerate(LORA_TARGETS)}
    return sorted(names, key=lambda name: order.get(name, len(order)))


_LORA_DEFAULTS = LoRAConfig()
LORA_FLAGS = (
    Flag("--lora-rank", ("lora.rank",), "fine-tune LoRA adapters of rank r on the routed "
         "experts only (needs --init-from; base weights frozen); at most min(d_in, d_out) of "
         "each adapted expert weight", default=NotGiven(text="none (no adapters)")),
    Flag("--lora-alpha", ("lora.alpha",), "LoRA alpha: the adapters' update is scaled by "
         "alpha / r", finite_float, default=NotGiven(text=str(_LORA_DEFAULTS.alpha))),
    Flag("--lora-dropout", ("lora.dropout",), "dropout probability on the adapters' input (the "
         "base path sees none)", finite_float, default=NotGiven(text=str(_LORA_DEFAULTS.dropout))),
    Flag("--lora-targets", ("lora.targets",), "adapted expert weights, comma-separated: w_up "
         "(gate/up projection), w_down", _targets,
         default=NotGiven(text=",".join(_LORA_DEFAULTS.targets))),
    Flag("--lora-train-router", ("lora.train_router",), "with --lora-rank, also train the "
         "routers (frozen otherwise)", action="store_true", default=NotGiven(text="False")),
    Flag("--lora-train-attention", ("lora.train_attention",), "with --lora-rank, also train "
         "attention, norms, embeddings and shared experts (frozen otherwise)",
         action="store_true", default=NotGiven(text="False")),
    Flag("--lora-base-quant", ("lora.base_quant",), "with --lora-rank, hold the routed "
         "experts' frozen base 4-bit (nf4: QLoRA, needs bitsandbytes; each expert's d*G and "
         "n*d must be multiples of 64)", str, ["nf4"], default=NotGiven(text="none")),
)

RUN_FLAGS = (
    Flag("--preset", (), "starting configuration; other flags override it", str,
         sorted(PRESETS), default=NotGiven(DEFAULT_PRESET)),
    Flag("--out", (), "run directory: config.json, metrics.jsonl, checkpoint.pt, summary.json, "
         "sample.txt", path_flag, default=NotGiven(text="runs/<preset>")),
    Flag("--resume", (), "continue from the checkpoint in --out (its config is used; only "
         f"{', '.join(RESUMABLE_FIELDS)} may be changed by flags)", action="store_true",
         default=NotGiven(False)),
    Flag("--overwrite", (), "replace the run already in --out (without it, any run file there "
         "stops the run)", action="store_true", default=NotGiven(False)),
    Flag("--init-from", (), "fine-tune: start from the weights of the checkpoint in this run "
         "directory (its model: flags may change chunking, budget, kernels and --seq-len, not "
         "the architecture; training settings from --preset and the flags; fresh optimizer and "
         "LR schedule; give the new --data)", path_flag,
         default=NotGiven(text="none")),
    Flag("--config", (), "TOML file of flag values (keys: flag names with underscores, e.g. "
         "max_steps = 400); flags given on the command line override it",
         file_flag("a TOML file of flag values"),
         default=NotGiven(text="none")),
    Flag("--tracker", (), "also send the logged scalars to an experiment tracker: "
         "'tensorboard' (--out/tensorboard), 'trackio' (its local store) or 'wandb' (offline "
         "mode unless WANDB_MODE says otherwise, files in --out/wandb); needs the package "
         "(pip install 'memfine[NAME]'); metrics.jsonl is written either way", str,
         choices=TRACKERS, default=NotGiven(text="none")),
    Flag("--tensorboard", (), "deprecated: the same as --tracker tensorboard",
         action="store_true", default=NotGiven(False)),
    Flag("--plot", (), "write chunks.png (chunk count, layer x step) and loss.png to --out",
         action="store_true", default=NotGiven(False)),
    Flag("--no-progress", (), "hide the progress bar (shown when stderr is a terminal)",
         action="store_true", default=NotGiven(False)),
    THREADS_FLAG,
    Flag("--ep", (), "size of the mesh dim 'ep': experts sharded E/ep over it; launch with "
         "torchrun --nproc_per_node W, W = dp-shard x ep", default=NotGiven(1)),
    Flag("--dp-shard", (), "size of the mesh dim 'dp_shard' (FSDP2 shards the experts over it; "
         "dense parameters over all W ranks); default W / ep", default=NotGiven(text="W/ep")),
    Flag("--backend", (), "torch.distributed backend under torchrun", str, ("gloo", "nccl"),
         default=NotGiven(text="gloo on cpu, nccl on cuda")),
)
SETTING_FLAGS = CONFIG_FLAGS + SWITCH_FLAGS + LORA_FLAGS
"""The flags that set TrainConfig fields (every flag but the run options)."""
