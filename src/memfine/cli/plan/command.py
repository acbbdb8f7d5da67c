"""``memfine plan``: which parallel layout fits, and what MemFine's MACT does under routing skew.

Terms (MemFine, arXiv 2511.21431):
  s'     rows one device's experts may receive per chunk within the memory budget (s'_max, Eq. 8)
  s''    rows they do receive per micro-batch: b·s·k·skew/(t·cp); skew 1 = balanced routing,
         worst = e·min(k, E/e)/k (every token sends this device all the rows it can)
  c      chunks MACT splits the expert part into: ceil(s''/s'_max) rounded up to a bin (Eq. 9)
  m_g    micro-batches (model chunks) whose activations a pipeline stage holds at once
         (1F1B: p - r on stage r; Eq. 2)
  alpha  usable fraction of device memory: a layout fits when static + activation <= alpha·M

Model sizes come from --preset, --hf-config (a transformers config.json: qwen3_moe, qwen2_moe,
deepseek_v3, mixtral, olmoe, gpt_oss) or the size flags (which override either). Run settings come
from the flags, then from the preset's setting (its publisher's layout where published; each
field is marked published or assumed), then from the defaults shown here. --search plans every
valid layout on --devices N and ranks the ones that fit at the worst skew by recompute FLOPs and
the 1F1B pipeline bubble (see memfine.plan.search). Byte sizes need a unit: 80GiB, 80GB (10^9),
512MiB. Output: a one-line answer first; --verbose adds the per-stage and per-skew tables;
--json prints everything as one JSON object. Exit status 0 when a plan was produced (fits or
not; the JSON says "fits"), 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from memfine.cli._flags import byte_size, flag_dest, name_flag
from memfine.cli.plan import output
from memfine.plan.hf_config import load_hf_config
from memfine.plan.layout import EXPERT_MODELS, RECOMPUTE_MODES, PlanConfig
from memfine.plan.presets import PRESETS, ModelPreset
from memfine.plan.search import check_devices, nearest_valid_devices, search
from memfine.units import DTYPE_BYTES, parse_bytes

# (flag, ModelPreset field, help) for the model sizes.
_SIZE_FLAGS = (
    ("--hidden-size", "hidden_size", "d, model width"),
    ("--moe-intermediate-size", "moe_intermediate_size", "n, routed-expert width per branch"),
    ("--num-experts", "num_experts", "E, routed experts per MoE layer"),
    ("--top-k", "top_k", "k, experts per token"),
    ("--num-layers", "num_layers", "L, transformer layers"),
    ("--num-dense-layers", "num_dense_layers", "leading layers with a dense FFN (< L)"),
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
_SETTING_FLAGS: tuple[tuple[str, str, Any, Any], ...] = (
    ("--device-memory", "device memory M per device, with a unit: 80GiB or 80GB", byte_size(),
     None),
    ("--alpha", "usable fraction alpha of device memory", float, None),
    ("--micro-batch", "b, sequences per micro-batch", int, None),
    ("--seq-len", "s, tokens per sequence", int, None),
    ("--global-batch", "sequences per optimizer step (for the pipeline bubble)", int, None),
    ("--dtype", "activation/parameter dtype", str, sorted(DTYPE_BYTES)),
    ("--recompute", "recompute mode", str, RECOMPUTE_MODES),
    ("--t", "tensor-parallel size t", int, None),
    ("--p", "pipeline-parallel size p", int, None),
    ("--e", "expert-parallel size e", int, None),
    ("--dp", "data-parallel size dp", int, None),
    ("--cp", "context-parallel size cp", int, None),
    ("--v", "virtual pipeline stages per rank v", int, None),
    ("--skew", "s'' as multiples of the balanced share b·s·k, comma-separated; "
     "'worst' = e·min(k, E/e)/k", str, None),
    ("--bins", "allowed chunk counts c, comma-separated, at most 16", str, None),
    ("--grad-bytes", "gradient bytes per parameter", int, None),
    ("--optimizer-bytes", "optimizer-state bytes per parameter", int, None),
    ("--static-memory", "measured static memory per device instead of Eq. 1, with a unit",
     byte_size(), None),
    ("--expert-model", "bytes per received row: MemFine Table 2 (paper) or memfine's fused "
     "path", str, EXPERT_MODELS),
)
_UNSET = argparse.SUPPRESS  # a flag not given leaves no attribute: preset, then default
_REQUIRED_SIZES = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "num_layers",
                   "num_heads")
_DEFAULTS: dict[str, Any] = {
    "device_memory": "80GiB", "alpha": 0.9, "micro_batch": 1, "seq_len": 4096,
    "global_batch": None, "dtype": "bfloat16", "recompute": "full", "t": 1, "p": 1, "e": 1,
    "dp": 1, "cp": 1, "v": 1, "skew": "1,2,4,8,16,worst", "bins": "1,2,4,8", "grad_bytes": 4,
    "optimizer_bytes": 12, "static_memory": None, "expert_model": "paper",
}
_BYTE_FLAGS = ("device_memory", "static_memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine plan`` flags (one per PlanConfig field, plus model and search)."""
    parser.description = (__doc__ or "").replace("``", "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted(PRESETS), default=_UNSET,
                       help="model sizes and the run setting it comes with")
    model.add_argument("--hf-config", metavar="PATH", default=_UNSET,
                       help="a transformers config.json, or a model directory holding one")
    for flag, _, text in _SIZE_FLAGS:
        parser.add_argument(flag, type=int, default=_UNSET, help=f"{text} (overrides the model)")
    for flag, text, kind, choices in _SETTING_FLAGS:
        key = flag_dest(flag)
        parser.add_argument(flag, type=kind, choices=choices, default=_UNSET,
                            help=f"{text} (default: the preset's setting, else "
                                 f"{_DEFAULTS[key]})")
    parser.add_argument("--no-distributed-optimizer", action="store_true",
                        help="keep the full optimizer state on every data-parallel rank")
    parser.add_argument("--search", action="store_true",
                        help="plan every valid layout on --devices N and rank those that fit")
    parser.add_argument("--devices", type=int, default=_UNSET, help="N, devices (--search)")
    parser.add_argument("--top", type=int, default=5, help="layouts shown by --search")
    parser.add_argument("--verbose", action="store_true",
                        help="per-stage and per-skew tables, resolved config")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _model(args: argparse.Namespace) -> ModelPreset:
    """The model from --preset / --hf-config / size flags (size flags override)."""
    given = {field: getattr(args, flag_dest(flag))
             for flag, field, _ in _SIZE_FLAGS if hasattr(args, flag_dest(flag))}
    if hasattr(args, "preset"):
        base: ModelPreset | None = PRESETS[args.preset]
    elif hasattr(args, "hf_config"):
        base = load_hf_config(args.hf_config)
    else:
        base = None
    if base is not None:
        return dataclasses.replace(base, **given) if given else base
    missing = [f for f in _REQUIRED_SIZES if f not in given]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        raise ValueError(f"give --preset, --hf-config or the model sizes; missing {flags}")
    d, heads = given["hidden_size"], given["num_heads"]
    kv = given.get("num_kv_heads", heads)
    hd = given.get("head_dim", d // heads if heads > 0 else 0)
    sizes = {"num_dense_layers": 0, "dense_intermediate_size": 0, "num_shared_experts": 0,
             "shared_intermediate_size": 0, "vocab_size": 32000, "num_kv_heads": kv,
             "head_dim": hd, "attention_params": 2 * d * heads * hd + 2 * d * kv * hd, **given}
    return ModelPreset(name="custom", tied_embeddings=False, source="explicit sizes", **sizes)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{flag} must be comma-separated ints such as 1,2,4,8, "
                         f"got {text!r}") from None


_SEARCHED = ("t", "p", "e", "dp", "cp", "v", "micro_batch", "recompute", "bins")


# The run-setting flags whose PlanConfig field has another name; the others are named alike.
_FLAG_FIELDS = {"skew": "skews", "device_memory": "device_memory_bytes",
                "static_memory": "static_bytes"}


def _typed_fields(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """``PlanConfig``/``ModelPreset`` field → (flag, value as given) of the flags given."""
    flags = [(flag, field) for flag, field, _ in _SIZE_FLAGS]
    flags += [(flag, _FLAG_FIELDS.get(flag_dest(flag), flag_dest(flag)))
              for flag, *_ in _SETTING_FLAGS]
    return {field: (flag, getattr(args, flag_dest(flag))) for flag, field in flags
            if hasattr(args, flag_dest(flag))}


def resolve(args: argparse.Namespace) -> tuple[PlanConfig, dict[str, str]]:
    """The :class:`PlanConfig` from the flags, the model's setting and the defaults.

    Under ``--search`` the layout fields the search enumerates (:data:`_SEARCHED`) keep their
    defaults: the search replaces them.

    Returns:
        The config and, per setting, where its value came from: ``flag``, ``published`` or
        ``assumed`` (the preset's setting), ``default``, or ``searched``.

    Raises:
        ValueError: on missing sizes, unparsable values or an invalid configuration (naming
            the flag that set the field, as typed).
    """
    try:
        return _resolve(args)
    except ValueError as err:
        raise ValueError(name_flag(err, _typed_fields(args))) from err


def _resolve(args: argparse.Namespace) -> tuple[PlanConfig, dict[str, str]]:
    model = _model(args)
    setting = model.setting
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, default in _DEFAULTS.items():
        if args.search and key in _SEARCHED:
            values[key], sources[key] = default, "searched"
        elif hasattr(args, key):
            values[key], sources[key] = getattr(args, key), "flag"
        elif setting is not None and setting.get(key) is not None:
            values[key], sources[key] = setting.get(key), setting.source_of(key)
        else:
            values[key], sources[key] = default, "default"
    for key in _BYTE_FLAGS:  # flags give bytes (byte_size); a preset's setting, text
        if values[key] is not None:
            values[key] = parse_bytes(values[key])
    skew_text = str(values.pop("skew"))
    cfg = PlanConfig(model=model, device_memory_bytes=values.pop("device_memory"),
                     static_bytes=values.pop("static_memory"),
                     bins=_ints(values.pop("bins"), "bins"),
                     distributed_optimizer=not args.no_distributed_optimizer, **values)
    skews = []
    for item in skew_text.split(","):
        try:
            skews.append(cfg.worst_skew if item.strip() == "worst" else float(item))
        except ValueError:
            raise ValueError(f"--skew must be numbers >= 1 or 'worst', got {item!r}") from None
    cfg = dataclasses.replace(cfg, skews=tuple(skews))  # validated (>= 1) before capping
    return dataclasses.replace(cfg, skews=tuple(dict.fromkeys(
        min(x, cfg.worst_skew) for x in skews))), sources


def run(args: argparse.Namespace) -> int:
    """Run ``memfine plan``; 0 when a plan was produced (fits or not)."""
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if hasattr(args, "devices"):
        check_devices(args.devices)  # a bad value first, with or without --search
    if args.search != hasattr(args, "devices"):
        raise ValueError("--search and --devices N go together")
    cfg, sources = resolve(args)
    if args.search:
        result = search(cfg, args.devices)
        if not result.considered:
            raise ValueError(_no_layout(cfg, args.devices))
        output.print_search(result, cfg, args.devices, top=args.top, as_json=args.json)
    else:
        output.print_plan(cfg, sources, verbose=args.verbose, as_json=args.json)
    return 0


def _no_layout(cfg: PlanConfig, devices: int) -> str:
    """Why no layout exists on ``devices`` and which device counts have one."""
    m = cfg.model
    below, above = nearest_valid_devices(cfg, devices)
    near = " or ".join(str(n) for n in (below, above) if n is not None)
    if above is None and below is not None:
        near += ", the most devices that have a layout"
    batch = (f", and dp·b dividing the global batch {cfg.global_batch} (--global-batch)"
             if cfg.global_batch is not None else "")
    return (f"no valid layout on {devices} devices: a layout needs N = t·p·dp·cp with t in "
            f"{{1, 2, 4, 8}} dividing the {m.num_heads} heads, cp in {{1, 2}} dividing "
            f"s/2 = {cfg.seq_len // 2}, p <= L = {m.num_layers}{batch}; try --devices {near}")
