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
the 1F1B pipeline bubble; ties go to the layout with the fewest kinds of parallelism, then the
least memory (see memfine.plan.search). Under the answer: the torchrun command that runs the
layout. Byte sizes need a unit: 80GiB, 80GB (10^9: a card's "80GB" is 80GiB), 512MiB.
Output: a one-line answer first; --verbose adds the per-stage and per-skew tables (of the first
layout under --search); --json prints everything as one JSON object. Exit status 0 when a
plan was produced (fits or not; the JSON says "fits"), 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any

from memfine._checks import FieldError
from memfine.config import RECOMPUTE_MODES
from memfine.flags.table import (
    Flag,
    NotGiven,
    add_flags,
    flag_dest,
    given,
    name_flag,
    typed_fields,
    value,
)
from memfine.flags.values import byte_size, comma_ints, finite_float, int64
from memfine.launch import report
from memfine.plan.hf_config import load_hf_config
from memfine.plan.layout import EXPERT_MODELS, PlanConfig
from memfine.plan.presets import PRESETS, ModelPreset, custom_model
from memfine.plan.search import check_devices, no_layout_message, search
from memfine.units import DTYPE_BYTES, decimal_gb_note, format_bytes, parse_bytes

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
SKEW_DEFAULT = "1,2,4,8,16,worst"
"""``--skew`` without the flag: a table over skews (``PlanConfig.skews`` holds numbers only)."""
# The run settings, one flag per PlanConfig field (paths[0]); the short spellings of the
# parallel sizes stay accepted as hidden aliases. Defaults come from PlanConfig (see _default).
SETTING_FLAGS = (
    Flag("--device-memory", ("device_memory_bytes",),
         "device memory M per device, with a unit: 80GiB or 80GB", type=byte_size()),
    Flag("--alpha", ("alpha",), "usable fraction alpha of device memory", type=finite_float),
    Flag("--micro-batch", ("micro_batch",), "b, sequences per micro-batch"),
    Flag("--seq-len", ("seq_len",), "s, tokens per sequence"),
    Flag("--global-batch", ("global_batch",),
         "sequences per optimizer step (for the pipeline bubble)"),
    Flag("--dtype", ("dtype",), "activation/parameter dtype", type=str,
         choices=sorted(DTYPE_BYTES)),
    Flag("--recompute", ("recompute",), "recompute mode", type=str, choices=RECOMPUTE_MODES),
    Flag("--tensor-parallel", ("t",), "tensor-parallel size t", aliases=("--t",)),
    Flag("--pipeline-parallel", ("p",), "pipeline-parallel size p", aliases=("--p",)),
    Flag("--expert-parallel", ("e",), "expert-parallel size e", aliases=("--e",)),
    Flag("--data-parallel", ("dp",), "data-parallel size dp", aliases=("--dp",)),
    Flag("--context-parallel", ("cp",), "context-parallel size cp", aliases=("--cp",)),
    Flag("--virtual-stages", ("v",), "virtual pipeline stages per rank v", aliases=("--v",)),
    Flag("--skew", ("skews",), "s'' as multiples of the balanced share b·s·k, comma-separated; "
         "'worst' = e·min(k, E/e)/k; values above worst are capped at it (and said so)",
         type=str, default=NotGiven(SKEW_DEFAULT)),
    Flag("--bins", ("bins",), "allowed chunk counts c, comma-separated, at most 16",
         type=comma_ints),
    Flag("--grad-bytes", ("grad_bytes",), "gradient bytes per parameter"),
    Flag("--optimizer-bytes", ("optimizer_bytes",), "optimizer-state bytes per parameter"),
    Flag("--static-memory", ("static_bytes",),
         "measured static memory per device instead of Eq. 1, with a unit", type=byte_size()),
    Flag("--expert-model", ("expert_model",), "bytes per received row: MemFine Table 2 "
         "(paper) or memfine's fused path", type=str, choices=EXPERT_MODELS),
)
_FIELDS = {f.name: f for f in dataclasses.fields(PlanConfig)}
# A preset's run setting names a few fields as the flags once did (text byte sizes).
_SETTING_KEYS = {"device_memory_bytes": "device_memory", "static_bytes": "static_memory",
                 "skews": "skew"}
_BYTE_FIELDS = ("device_memory_bytes", "static_bytes")
_UNSET = argparse.SUPPRESS  # a model flag not given leaves no attribute: the model's own value


def _default(flag: Flag) -> NotGiven:
    """The flag's default: its PlanConfig field's default, shown in --help."""
    default: Any = _FIELDS[flag.paths[0]].default
    if flag.paths[0] in _BYTE_FIELDS and default is not None:
        return NotGiven(default, format_bytes(default))
    if isinstance(default, tuple):
        return NotGiven(default, ",".join(map(str, default)))
    return NotGiven(default)


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
        parser.add_argument(flag, type=int64, default=_UNSET,
                            help=f"{text} (overrides the model)")
    add_flags(parser, [dataclasses.replace(f, help=f"{f.help} (default: the preset's setting, "
                                           "else %(default)s)") for f in SETTING_FLAGS],
              default_for=_default)
    parser.add_argument("--no-distributed-optimizer", action="store_true",
                        help="keep the full optimizer state on every data-parallel rank")
    parser.add_argument("--search", action="store_true",
                        help="plan every valid layout on --devices N and rank those that fit")
    parser.add_argument("--devices", type=int64, default=_UNSET, help="N, devices (--search)")
    parser.add_argument("--top", type=int64, default=5, help="layouts shown by --search")
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
    return custom_model(given)


_SEARCHED = ("t", "p", "e", "dp", "cp", "v", "micro_batch", "recompute", "bins")


def _typed_fields(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """``PlanConfig``/``ModelPreset`` field → (flag, value as given) of the flags given."""
    typed = {field: (flag, getattr(args, flag_dest(flag))) for flag, field, _ in _SIZE_FLAGS
             if hasattr(args, flag_dest(flag))}
    return {**typed, **typed_fields(args, SETTING_FLAGS)}


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
        raise ValueError(_in_flags(err, _typed_fields(args))) from err


_FLAG_OF = {f.paths[0]: f.name for f in SETTING_FLAGS}


def _in_flags(err: ValueError, typed: dict[str, tuple[str, Any]]) -> str:
    """A PlanConfig error in flags (``PlanConfig.e ...`` → ``--expert-parallel ...``).

    A field set by a flag names that flag as typed; a field from the model's setting or a
    default names the flag that would set it.
    """
    if isinstance(err, FieldError) and err.field not in typed and err.field in _FLAG_OF:
        message = (f"{_FLAG_OF[err.field]} must be {err.plain}, got {err.value!r} (not given: "
                   "the model's setting or the default)")
    else:
        message = name_flag(err, typed)
    return re.sub(r"t·dp·cp=(\d+)", r"t·dp·cp=\1 (--tensor-parallel · --data-parallel · "
                  r"--context-parallel)", message)


def _check_searched_not_given(args: argparse.Namespace) -> None:
    """Refuse a layout flag under ``--search``: the search picks that size itself.

    Raises:
        ValueError: naming the first such flag and its value.
    """
    for flag in SETTING_FLAGS:
        if flag.paths[0] in _SEARCHED and given(args, flag.dest):
            typed = getattr(args, flag.dest)
            typed = ",".join(map(str, typed)) if isinstance(typed, tuple | list) else typed
            raise ValueError(f"{flag.name} {typed} is chosen by --search (it "
                             "tries every t, p, e, dp, cp, v, micro-batch, recompute and bins): "
                             "drop it, or plan that one layout without --search")


def _resolve(args: argparse.Namespace) -> tuple[PlanConfig, dict[str, str]]:
    if args.search:
        _check_searched_not_given(args)
    model = _model(args)
    setting = model.setting
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag in SETTING_FLAGS:
        field = flag.paths[0]
        key = _SETTING_KEYS.get(field, field)
        if args.search and field in _SEARCHED:
            values[field], sources[key] = value(args, flag.dest), "searched"
        elif given(args, flag.dest):
            values[field], sources[key] = getattr(args, flag.dest), "flag"
        elif setting is not None and setting.get(key) is not None:
            values[field], sources[key] = setting.get(key), setting.source_of(key)
            if field in _BYTE_FIELDS:  # a preset's setting gives text: "80GiB"
                values[field] = parse_bytes(values[field])
        else:
            values[field], sources[key] = value(args, flag.dest), "default"
    try:
        values["bins"] = comma_ints(",".join(map(str, values["bins"]))
                                    if isinstance(values["bins"], tuple) else values["bins"])
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"--bins: {err}") from None
    skew_text = str(values.pop("skews"))
    cfg = PlanConfig(model=model, distributed_optimizer=not args.no_distributed_optimizer,
                     **values)
    _check_mixed_layout(values, sources, model.name)  # once each size is valid
    skews = []
    for item in skew_text.split(","):
        try:
            skews.append(cfg.worst_skew if item.strip() == "worst" else float(item))
        except ValueError:
            raise ValueError(f"--skew must be numbers >= 1 or 'worst', got {item!r}") from None
    cfg = dataclasses.replace(cfg, skews=tuple(skews))  # validated (>= 1) before capping
    capped = [x for x in skews if x > cfg.worst_skew]
    # the default list goes up to 16 on purpose; --search plans each layout at its own worst
    if capped and given(args, "skew") and not args.search:
        shown = ", ".join(f"{x:g}" for x in capped)
        print(f"memfine plan: --skew {shown}: above the worst case e·min(k, E/e)/k = "
              f"{cfg.worst_skew:g} of this model and layout; planned at {cfg.worst_skew:g}",
              file=sys.stderr)
    return dataclasses.replace(cfg, skews=tuple(dict.fromkeys(
        min(x, cfg.worst_skew) for x in skews))), sources


def _check_mixed_layout(values: dict[str, Any], sources: dict[str, str], model: str) -> None:
    """Refuse parallel sizes given by flags beside a preset's other sizes (not 1) kept silently.

    Raises:
        ValueError: naming the flags given, the preset's sizes kept and the device count the mix
            would answer for.
    """
    sizes = ("t", "p", "e", "dp", "cp", "v")
    given_ = [f for f in sizes if sources[f] == "flag"]
    kept = [f for f in sizes if sources[f] in ("published", "assumed") and values[f] != 1]
    if given_ and kept:
        devices = values["t"] * values["p"] * values["dp"] * values["cp"]
        raise ValueError(
            " ".join(f"{_FLAG_OF[f]} {values[f]}" for f in given_)
            + (" mixes" if len(given_) == 1 else " mix") + f" with {model}'s "
            + ", ".join(f"{sources[f]} {_FLAG_OF[f]} {values[f]}" for f in kept)
            + f": that layout is {devices} devices (t·p·dp·cp); give "
            + " ".join(f"{_FLAG_OF[f]}" for f in kept) + " too (1 for none), or use --search "
            "--devices N")


def run(args: argparse.Namespace) -> int:
    """Run ``memfine plan``; 0 when a plan was produced (fits or not)."""
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if hasattr(args, "devices"):
        check_devices(args.devices)  # a bad value first, with or without --search
    if args.search != hasattr(args, "devices"):
        raise ValueError("--search and --devices N go together")
    cfg, sources = resolve(args)
    hint = (decimal_gb_note(cfg.device_memory_bytes, "--device-memory")
            if sources["device_memory"] == "flag" else None)
    if hint is not None:
        print(f"memfine plan: {hint}", file=sys.stderr)
    if args.search:
        result = search(cfg, args.devices)
        if not result.considered:
            raise ValueError(no_layout_message(cfg, args.devices))
        report.print_search(result, cfg, args.devices, top=args.top, as_json=args.json,
                            verbose=args.verbose)
    else:
        report.print_plan(cfg, sources, verbose=args.verbose, as_json=args.json)
    return 0
