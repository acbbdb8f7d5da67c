"""``memfine bench``: memory and speed of MoE methods side by side, on your shapes and machine.

Suites: ``experts`` (one MoE layer forward + backward: plain PyTorch, per-expert loop, grouped_mm,
memfine fused, fused + MACT, full-layer recompute), ``chunking`` (MemFine's methods as routing
skew grows), ``model`` (a training step of the small MoE language model) and ``hf`` (transformers'
experts block; needs ``memfine[hf]``). Every method of a point runs in this process, in
interleaved order, after warm-up; for each: time (p20/p50/p80 over repeats), tokens/s, bytes
saved for backward, peak live bytes, and the memory model's prediction next to the measured
values. On a GPU the same command times with CUDA events and reads the allocator's statistics.

Output in ``--out``: ``bench_config.json`` (resolved options and environment, written first),
``bench_<suite>.csv`` (docs/style.md §6 columns, with units and environment) and
``bench_<suite>_{time,memory,predicted[,skew]}.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from memfine.bench import SUITES, BenchOptions, select_methods
from memfine.bench.options import DEVICES, DTYPES, TABLE1
from memfine.bench.runner import run_suites
from memfine.units import parse_bytes


class _QuickDefault:
    """Default of a flag that differs under ``--quick``."""

    __slots__ = ("normal", "quick")

    def __init__(self, normal: int, quick: int) -> None:
        self.normal, self.quick = normal, quick

    def __repr__(self) -> str:
        return f"{self.normal} ({self.quick} with --quick)"

    def resolve(self, quick: bool) -> int:
        """The value for this run."""
        return self.quick if quick else self.normal


class _Unset:
    """Default of a flag that was not given (resolved to ``None``); ``--help`` prints ``text``."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _given(value: Any) -> Any:
    return None if isinstance(value, _Unset) else value


def _levels(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 1,2,4,8, got "
                                         f"{text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine bench`` flags (one per :class:`BenchOptions` field)."""
    parser.add_argument("--suite", nargs="+", choices=(*SUITES, "all"), default=_Unset("all"),
                        help="suites to run")
    parser.add_argument("--config", type=int, nargs="+", choices=sorted(TABLE1),
                        default=_Unset("experts 1 2 3 5, hf 1 5, chunking its skew_demo shape"),
                        help="MoEBlaze Table 1 rows (d, E, k; n = 4d) for the experts, chunking "
                             "and hf suites")
    parser.add_argument("--scale-down", type=int, default=256,
                        help="divide the paper's batch x seq by this factor (d, E, k, n kept)")
    from_shape = _Unset("the shape's")
    parser.add_argument("--tokens", type=int, default=from_shape,
                        help="T, tokens per layer call (model: per step)")
    parser.add_argument("--hidden-size", type=int, default=from_shape, help="d")
    parser.add_argument("--intermediate-size", type=int, default=_Unset("4d with --hidden-size"),
                        help="n per GLU branch")
    parser.add_argument("--num-experts", type=int, default=from_shape, help="E")
    parser.add_argument("--top-k", type=int, default=from_shape, help="k, experts per token")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="activation and weight dtype (bf16 matmuls are slow on CPUs)")
    parser.add_argument("--threads", type=int, default=_Unset("torch's choice; 1 with --quick"),
                        help="torch intra-op threads (restored when the run ends)")
    parser.add_argument("--repeats", type=int, default=_QuickDefault(5, 1),
                        help="timed rounds per method")
    parser.add_argument("--warmup", type=int, default=_QuickDefault(1, 0),
                        help="untimed rounds per method first")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"),
                        help="output folder: bench_config.json, bench_<suite>.csv and PNGs")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny shapes, 1 round, no warm-up, 1 thread (under a "
                             "minute)")
    parser.add_argument("--methods", nargs="+", default=_Unset("all of each suite"),
                        help="run only these methods (names as in the table)")
    parser.add_argument("--budget", default="auto",
                        help="MACT memory budget per MoE layer, e.g. 512MiB; 'auto': the "
                             "suite's own (experts/model: half the received rows per chunk; "
                             "chunking: the worst skew level with c = 8)")
    parser.add_argument("--skew-levels", type=_levels, default="1,2,4,8",
                        help="chunking suite: received rows as multiples of the balanced share")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="cuda when available with 'auto'")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, inputs, routing")


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available in this torch build or machine")
    return torch.device(choice)


def options_from_args(args: argparse.Namespace, device: torch.device) -> BenchOptions:
    """Resolve the parsed flags into :class:`BenchOptions`.

    Raises:
        ValueError: on invalid values (the message names the option).
    """
    chosen = _given(args.suite) or ["all"]
    suites = SUITES if "all" in chosen else tuple(dict.fromkeys(chosen))
    repeats, warmup = args.repeats, args.warmup
    return BenchOptions(
        suites=suites, configs=tuple(_given(args.config) or ()),
        scale_down=args.scale_down, tokens=_given(args.tokens),
        hidden_size=_given(args.hidden_size),
        intermediate_size=_given(args.intermediate_size),
        num_experts=_given(args.num_experts), top_k=_given(args.top_k),
        dtype=args.dtype, threads=_given(args.threads) or (1 if args.quick else None),
        repeats=repeats.resolve(args.quick) if isinstance(repeats, _QuickDefault) else repeats,
        warmup=warmup.resolve(args.quick) if isinstance(warmup, _QuickDefault) else warmup,
        out=str(args.out), quick=args.quick,
        methods=tuple(_given(args.methods) or ()),
        budget_bytes=None if str(args.budget).lower() == "auto" else parse_bytes(args.budget),
        skew_levels=tuple(args.skew_levels), device=device.type, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    """Run the selected suites; print tables, write CSV, PNG and JSON.

    Returns:
        0, or 1 when any method failed (its error is printed in full after the tables).
    """
    device = _device(args.device)
    opts = options_from_args(args, device)
    for suite in opts.suites:
        select_methods(suite, opts.methods)  # fail on unknown names before any work
    failures = run_suites(opts, device)
    for failure in failures:
        print(f"memfine bench: method failed: {failure}", file=sys.stderr)
    return 1 if failures else 0
