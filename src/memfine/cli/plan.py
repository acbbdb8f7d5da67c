"""``memfine plan``: predict memory per pipeline stage and the MACT chunk count, before launching.

A thin front end over :class:`memfine.memory.stage.PlanConfig`: one flag per field, plus
``--preset`` and the model sizes. Values not given come from the preset (its model sizes and,
for the MemFine presets, the paper's run settings), then from the defaults shown in ``--help``.
Prints the resolved config, an itemised table per stage (static memory, activation per layer,
s′_max) and, per skew level, the received rows s″, the chunk count MACT chooses and whether the
run fits; ``--json`` prints the same as one JSON object. Exit code 0 when everything fits, 1 when
a setting is infeasible (the message names the smallest device memory that would fit).

Bytes are shown in MiB = 2^20 and GiB = 2^30 bytes; byte sizes are read as ``"64GiB"``,
``"80GB"`` (10^9) or an integer.
Reference: MemFine Eq. 1-3, 8, 9 (arXiv 2511.21431); docs/design.md §4, §7.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from memfine.memory.presets import PRESETS, ModelPreset
from memfine.memory.stage import (
    EXPERT_MODELS,
    RECOMPUTE_MODES,
    PlanConfig,
    layer_activation,
    plan_stage,
)
from memfine.units import DTYPE_BYTES, format_bytes, parse_bytes

# (flag, ModelPreset field, help) for the model sizes.
_SIZE_FLAGS = (
    ("--hidden-size", "hidden_size", "d, model width"),
    ("--moe-intermediate-size", "moe_intermediate_size", "n, routed-expert width per branch"),
    ("--num-experts", "num_experts", "E, routed experts per MoE layer"),
    ("--top-k", "top_k", "k, experts per token"),
    ("--num-layers", "num_layers", "L, transformer layers"),
    ("--num-dense-layers", "num_dense_layers", "leading layers with a dense FFN"),
    ("--dense-intermediate-size", "dense_intermediate_size", "dense FFN width per branch"),
    ("--num-shared-experts", "num_shared_experts", "shared experts per MoE layer"),
    ("--shared-intermediate-size", "shared_intermediate_size", "shared-expert width"),
    ("--num-heads", "num_heads", "a, attention heads"),
    ("--num-kv-heads", "num_kv_heads", "k_a, key/value heads (default: a)"),
    ("--head-dim", "head_dim", "h_d, head size (default: d/a)"),
    ("--attention-params", "attention_params", "parameters of one attention block "
     "(default: GQA projections)"),
    ("--vocab-size", "vocab_size", "V, vocabulary size"),
)
# (flag, help, type, choices) of the run settings; the flag's dest keys _DEFAULTS.
_SETTING_FLAGS: tuple[tuple[str, str, type | None, Sequence[str] | None], ...] = (
    ("--device-memory", "device memory M_device, e.g. 64GiB", None, None),
    ("--alpha", "usable fraction α of device memory", float, None),
    ("--micro-batch", "b, sequences per micro-batch", int, None),
    ("--seq-len", "s, tokens per sequence", int, None),
    ("--dtype", "activation/parameter dtype", None, sorted(DTYPE_BYTES)),
    ("--recompute", "recompute mode", None, RECOMPUTE_MODES),
    ("--t", "tensor-parallel size t", int, None),
    ("--p", "pipeline-parallel size p", int, None),
    ("--e", "expert-parallel size e", int, None),
    ("--dp", "data-parallel size dp", int, None),
    ("--cp", "context-parallel size cp", int, None),
    ("--v", "virtual pipeline stages per rank v", int, None),
    ("--skew", "received rows as multiples of the balanced share s·k, comma-separated; "
     "'worst' = e·min(k, E/e)/k", None, None),
    ("--bins", "allowed chunk counts", None, None),
    ("--grad-bytes", "gradient bytes per parameter", int, None),
    ("--optimizer-bytes", "optimizer-state bytes per parameter", int, None),
)
_UNSET = argparse.SUPPRESS  # a flag not given leaves no attribute: preset, then default
_REQUIRED_SIZES = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "num_layers",
                   "num_heads")
_DEFAULTS: dict[str, Any] = {
    "device_memory": "80GiB", "alpha": 0.9, "micro_batch": 1, "seq_len": 4096,
    "dtype": "bfloat16", "recompute": "full", "t": 1, "p": 1, "e": 1, "dp": 1, "cp": 1, "v": 1,
    "skew": "1,2,4,8,16,worst", "bins": "1,2,4,8", "grad_bytes": 4, "optimizer_bytes": 12,
    "expert_model": "paper",
}


def _help(text: str, key: str) -> str:
    return f"{text} (default: the preset's setting, else {_DEFAULTS[key]})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine plan`` flags (one per PlanConfig field, plus preset and sizes)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=_UNSET,
                        help="model sizes (and run settings for memfine-paper-*)")
    for flag, _, text in _SIZE_FLAGS:
        parser.add_argument(flag, type=int, default=_UNSET,
                            help=f"{text} (overrides the preset)")
    for flag, text, kind, choices in _SETTING_FLAGS:
        parser.add_argument(flag, type=kind, choices=choices, default=_UNSET,
                            help=_help(text, flag[2:].replace("-", "_")))
    parser.add_argument("--no-distributed-optimizer", action="store_true",
                        help="keep the full optimizer state on every data-parallel rank")
    parser.add_argument("--static-memory", default=_UNSET,
                        help="measured static memory per device instead of Eq. 1 (default: "
                             "the preset's measured value, else Eq. 1)")
    parser.add_argument("--expert-model", choices=EXPERT_MODELS, default=_UNSET,
                        help=_help("bytes per received row: MemFine Table 2 or memfine's own "
                                   "fused path", "expert_model"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _model(args: argparse.Namespace) -> ModelPreset:
    name = getattr(args, "preset", None)
    base = PRESETS[name] if name else None
    given = {field: getattr(args, flag[2:].replace("-", "_"), None)
             for flag, field, _ in _SIZE_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if base is not None:
        return dataclasses.replace(base, **given) if given else base
    missing = [f for f in _REQUIRED_SIZES if f not in given]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        raise ValueError(f"give --preset or the model sizes; missing {flags}")
    d, heads = given["hidden_size"], given["num_heads"]
    kv = given.get("num_kv_heads", heads)
    hd = given.get("head_dim", d // heads)
    return ModelPreset(
        name="custom", hidden_size=d, moe_intermediate_size=given["moe_intermediate_size"],
        num_experts=given["num_experts"], top_k=given["top_k"],
        num_layers=given["num_layers"], num_dense_layers=given.get("num_dense_layers", 0),
        dense_intermediate_size=given.get("dense_intermediate_size", 0),
        num_shared_experts=given.get("num_shared_experts", 0),
        shared_intermediate_size=given.get("shared_intermediate_size", 0),
        num_heads=heads, num_kv_heads=kv, head_dim=hd,
        attention_params=given.get("attention_params", 2 * d * heads * hd + 2 * d * kv * hd),
        vocab_size=given.get("vocab_size", 32000), tied_embeddings=False,
        source="explicit sizes")


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated ints such as 1,2,4,8, "
                         f"got {text!r}") from None


def resolve(args: argparse.Namespace) -> PlanConfig:
    """The :class:`PlanConfig` from the flags, the preset's settings and the defaults.

    Raises:
        ValueError: on missing sizes, unparsable values or an invalid configuration.
    """
    model = _model(args)
    setting = dataclasses.asdict(model.setting) if model.setting else {}

    def pick(key: str) -> Any:
        value = getattr(args, key, None)
        if value is not None:
            return value
        return setting.get(key, _DEFAULTS.get(key))

    static = getattr(args, "static_memory", None)
    if static is None:
        static = setting.get("static_memory")
    cfg = PlanConfig(
        model=model, device_memory_bytes=parse_bytes(pick("device_memory")),
        alpha=pick("alpha"), micro_batch=pick("micro_batch"), seq_len=pick("seq_len"),
        dtype=pick("dtype"), recompute=pick("recompute"),
        **{k: pick(k) for k in ("t", "p", "e", "dp", "cp", "v")},
        bins=_ints(pick("bins"), "bins"), grad_bytes=pick("grad_bytes"),
        optimizer_bytes=pick("optimizer_bytes"),
        distributed_optimizer=not args.no_distributed_optimizer,
        static_bytes=None if static is None else parse_bytes(static),
        expert_model=pick("expert_model"))
    skews = []
    for item in str(pick("skew")).split(","):
        try:
            skews.append(cfg.worst_skew if item.strip() == "worst" else float(item))
        except ValueError:
            raise ValueError(f"--skew must be numbers >= 1 or 'worst', got {item!r}") from None
    return dataclasses.replace(cfg, skews=tuple(dict.fromkeys(
        min(x, cfg.worst_skew) for x in skews)))


def build_plan(cfg: PlanConfig) -> dict[str, Any]:
    """The JSON-ready plan: config, per-layer activation, stages, verdict and errors."""
    stages = [plan_stage(cfg, r) for r in range(cfg.p)]
    config = dataclasses.asdict(cfg)
    config["model"].pop("setting", None)
    errors = []
    c_max = cfg.bins[-1] if cfg.recompute != "none" else 1
    for st in stages:
        failed = [sk for sk in st["skews"] if not sk["fits"]]
        static_limited = [sk for sk in failed if sk["chunks_needed"] is None]
        if static_limited:  # one message per stage: its largest requirement
            sk = max(static_limited, key=lambda x: x["min_device_memory_bytes"])
            kept = max(st["fixed_activation_bytes"], st["floor_activation_bytes"])
            errors.append(
                f"stage {st['rank']}: static {format_bytes(st['static_bytes'])} + activation "
                f"that does not scale with s' {format_bytes(kept)} exceed the budget alpha*M = "
                f"{format_bytes(st['budget_bytes'])}; the smallest device memory that fits "
                f"(skew {sk['skew']:g}, c={c_max}, alpha={cfg.alpha:g}) is "
                f"{format_bytes(sk['min_device_memory_bytes'])}")
        for sk in failed:
            if sk["chunks_needed"] is None:
                continue
            errors.append(
                f"stage {st['rank']} at skew {sk['skew']:g}: s''={sk['recv_rows']} rows need "
                f"c=ceil({sk['recv_rows']}/{st['s_prime_max']})={sk['chunks_needed']} > "
                f"largest bin {c_max}; the smallest device memory that fits (c={c_max}, "
                f"alpha={cfg.alpha:g}) is {format_bytes(sk['min_device_memory_bytes'])}")
    layers = {kind: dataclasses.asdict(layer_activation(cfg, moe_layer=moe))
              for kind, moe in (("dense", False), ("moe", True))}
    fits = not errors
    need = max(sk["min_device_memory_bytes"] for st in stages for sk in st["skews"])
    return {"config": config, "layer_activation": layers, "stages": stages, "fits": fits,
            "min_device_memory_bytes": need, "errors": errors}


def _table(plan: dict[str, Any], cfg: PlanConfig) -> str:
    m = cfg.model
    lines = [f"model {m.name}: d={m.hidden_size} n={m.moe_intermediate_size} E={m.num_experts} "
             f"k={m.top_k} L={m.num_layers} ({m.num_dense_layers} dense); {m.source}",
             f"run: {cfg.dtype} b={cfg.micro_batch} s={cfg.seq_len} recompute={cfg.recompute} "
             f"t={cfg.t} p={cfg.p} e={cfg.e} dp={cfg.dp} cp={cfg.cp} v={cfg.v} "
             f"device={format_bytes(cfg.device_memory_bytes)} alpha={cfg.alpha:g} "
             f"bins={list(cfg.bins)} worst skew={cfg.worst_skew:g}"]
    moe = plan["layer_activation"]["moe"]
    lines.append("activation per MoE layer and micro-batch (MemFine Table 2, /(t·cp)): "
                 f"attention+router {format_bytes(moe['attention_bytes'])}, shared experts "
                 f"{format_bytes(moe['shared_expert_bytes'])}, layer input "
                 f"{format_bytes(moe['layer_input_bytes'])}, expert part "
                 f"{moe['expert_row_bytes']} bytes per received row")
    for st in plan["stages"]:
        layers = st["layers"]
        lines.append(
            f"stage {st['rank']} (layers {layers[0]}-{layers[-1]}, m_g={st['in_flight_chunks']})"
            f": parameters {format_bytes(st['parameter_bytes'])}, gradients "
            f"{format_bytes(st['gradient_bytes'])}, optimizer "
            f"{format_bytes(st['optimizer_state_bytes'])} = Eq. 1 static "
            f"{format_bytes(st['eq1_static_bytes'])}; static used "
            f"{format_bytes(st['static_bytes'])}; budget alpha*M "
            f"{format_bytes(st['budget_bytes'])}; activation not scaling with s' "
            f"{format_bytes(st['fixed_activation_bytes'])}; s'_max {st['s_prime_max']} rows")
        lines.append(f"  {'skew':>6} {'s_rows':>9} {'c_need':>6} {'MACT c':>6} "
                     f"{'act c=1':>11} {'act c=max':>11} {'act MACT':>11} {'total':>11} fits")
        for sk in st["skews"]:
            c = "-" if sk["num_chunks"] is None else str(sk["num_chunks"])
            need = "-" if sk["chunks_needed"] is None else str(sk["chunks_needed"])
            lines.append(f"  {sk['skew']:>6g} {sk['recv_rows']:>9} {need:>6} {c:>6} "
                         f"{format_bytes(sk['activation_unchunked_bytes']):>11} "
                         f"{format_bytes(sk['activation_max_chunks_bytes']):>11} "
                         f"{format_bytes(sk['activation_bytes']):>11} "
                         f"{format_bytes(sk['total_bytes']):>11} "
                         f"{'yes' if sk['fits'] else 'NO'}")
    lines.append(f"fits: {'yes' if plan['fits'] else 'no'}; smallest device memory that fits "
                 f"every stage and skew: {format_bytes(plan['min_device_memory_bytes'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``memfine plan``; returns 0 when the run fits, 1 when it does not."""
    cfg = resolve(args)
    plan = build_plan(cfg)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print("config: " + json.dumps(plan["config"]))
        print(_table(plan, cfg))
    for err in plan["errors"]:
        print(f"memfine plan: infeasible: {err}", file=sys.stderr)
    return 0 if plan["fits"] else 1
