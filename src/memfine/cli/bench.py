"""``memfine bench``: memory and speed of MoE methods side by side, on your shapes and machine.

Suites: ``experts`` (one MoE layer forward + backward: plain PyTorch, per-expert loop, grouped_mm,
memfine fused, fused + MACT, full-layer recompute), ``chunking`` (MemFine's methods as routing
skew grows), ``model`` (a training step of the small MoE language model) and ``hf`` (transformers'
experts block; needs ``memfine[hf]``). Every method of a point runs in this process, in
interleaved order, after warm-up; for each: time (p20/p50/p80 over repeats), tokens/s, bytes
saved for backward, peak live bytes, and the memory model's prediction next to the measured
values. On a GPU the same command times with CUDA events and reads the allocator's statistics.

Output in ``--out`` (refused when it already holds ``bench_*`` files, unless ``--overwrite``):
``bench_config.json`` (resolved options and environment, written with the first point),
``bench_<suite>.csv`` (docs/style.md §6 columns, with units and environment) and
``bench_<suite>_{time,memory,predicted[,skew]}.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from memfine.artifacts.rundir import check_bench_out
from memfine.bench import SUITES, BenchOptions
from memfine.bench.options import COMPILE_BACKENDS, DEVICES, DTYPES, TABLE1
from memfine.flags.table import Flag, NotGiven, add_flags, name_flag, typed_fields, value
from memfine.flags.threads import clamp_threads
from memfine.flags.values import byte_size, comma_ints, int64, path_flag
from memfine.schedule.wording import flag_words
from memfine.suites import SUITE_MODULES, select_methods
from memfine.suites.runner import COUNT_DEVICE, OVERWRITE, TOKENS, run_suites
from memfine.units import format_bytes

_FROM_SHAPE = NotGiven(text="the shape's")
_FLAGS = (
    Flag("--suites", ("suites",), "suites to run", str, (*SUITES, "all"), NotGiven(text="all"),
         "+", aliases=("--suite",)),
    Flag("--configs", ("configs",), "MoEBlaze Table 1 rows (d, E, k; n = 4d) for the experts, "
         "chunking and hf suites", int64, sorted(TABLE1),
         NotGiven(text="experts 1 2 3 5, hf 1 5, chunking its skew_demo shape"), "+",
         aliases=("--config",)),
    Flag("--scale-down", ("scale_down",), "divide the paper's batch x seq by this factor (d, E, "
         "k, n kept)", default=NotGiven(256)),
    TOKENS,
    Flag("--hidden-size", ("hidden_size",), "d", default=_FROM_SHAPE),
    Flag("--intermediate-size", ("intermediate_size",), "n per GLU branch",
         default=NotGiven(text="4d with --hidden-size")),
    Flag("--num-experts", ("num_experts",), "E", default=_FROM_SHAPE),
    Flag("--top-k", ("top_k",), "k, experts per token", default=_FROM_SHAPE),
    Flag("--dtype", ("dtype",), "activation and weight dtype (bf16 matmuls are slow on CPUs; "
         "the counts suite counts bf16 and does not read it)",
         str, DTYPES, NotGiven("float32")),
    Flag("--threads", ("threads",), "torch intra-op threads, >= 1 (restored when the run ends; "
         "not read by the counts suite)", default=NotGiven(text="torch's choice; 1 with --quick")),
    Flag("--repeats", ("repeats",), "timed rounds per method",
         default=NotGiven(text="5 (1 with --quick)")),
    Flag("--warmup", ("warmup",), "untimed rounds per method first",
         default=NotGiven(text="1 (0 with --quick)")),
    Flag("--out", ("out",), "output folder: bench_config.json, bench_<suite>.csv and PNGs",
         path_flag, default=NotGiven(Path("runs/bench"))),
    OVERWRITE,
    Flag("--quick", ("quick",), "smoke run: tiny shapes, 1 round, no warm-up, 1 thread (under "
         "a minute)", action="store_true", default=NotGiven(False)),
    Flag("--methods", ("methods",), "run only these methods (names as in the table)", str,
         default=NotGiven(text="all of each suite"), nargs="+"),
    Flag("--memory-budget", ("budget_bytes",), "MACT memory budget per MoE layer, e.g. 512MiB; "
         "'auto': the suite's own (experts/model: half the received rows per chunk; chunking: "
         "the worst skew level with c = 8)", byte_size("auto"), default=NotGiven(text="auto"),
         aliases=("--budget",)),
    Flag("--skew-levels", ("skew_levels",), "chunking suite: received rows as multiples of the "
         "balanced share", comma_ints, default=NotGiven((1, 2, 4, 8), text="1,2,4,8")),
    Flag("--device", ("device",), "cuda when available with 'auto'", str, DEVICES,
         NotGiven("auto")),
    Flag("--seed", ("seed",), "seed of weights, inputs, routing", default=NotGiven(0)),
    Flag("--compile", ("compile",), "add a compiled column: <method>_compiled (torch.compile) "
         "for the memfine methods of the experts and model suites; peak bytes from "
         "torch.profiler", action="store_true", default=NotGiven(False)),
    COUNT_DEVICE,
    Flag("--compile-backend", ("compile_backend",), "torch.compile backend of the compiled "
         "methods (aot_eager: no code generation)", str, COMPILE_BACKENDS,
         NotGiven("inductor")),
)


_BUDGET_NAMES = {"budget": "--memory-budget", "bins": None, "allow": None}
"""How a budget error names the settings: bench has ``--memory-budget`` only (its suites' bins
are their own), so the advice is to raise it."""


_COUNTS_SHAPES = "its shapes are its presets (--tokens, --num-experts and --top-k change them)"
_IGNORED = {"counts": {
    "configs": _COUNTS_SHAPES, "scale_down": _COUNTS_SHAPES,
    "hidden_size": "it counts at its presets' d and n, divided by 16",
    "intermediate_size": "it counts at its presets' d and n, divided by 16",
    "dtype": "it counts bfloat16 layers", "repeats": "it counts each method once",
    "threads": "op and sync counts do not depend on torch's threads",
    "warmup": "each method runs one untimed call first",
    "memory_budget": "its mact method's budget is its own, half the received rows per chunk",
    "skew_levels": "it routes as its presets do (a flag of the chunking suite)",
    "compile": "it has no compiled methods", "compile_backend": "it has no compiled methods"}}
"""Per suite, the flags (by dest) it does not read, and why; see :func:`_check_flags_read`."""
_OWN_VALUES = {"counts": {"dtype": ("bfloat16", "torch.bfloat16")}}  # what it does anyway: kept


def _check_flags_read(args: argparse.Namespace, suites: tuple[str, ...]) -> None:
    """Refuse a flag given on the command line that none of the selected suites reads.

    A flag whose value means "the suite's own" (``--memory-budget auto``) is never refused.

    Raises:
        ValueError: naming the flag, its value as typed, the suite(s) and why they do not read it.
    """
    typed = {flag: got for flag, got in typed_fields(args, _FLAGS).values()}
    for flag in _FLAGS:
        if (flag.name not in typed or value(args, flag.dest) is None
                or not all(flag.dest in _IGNORED.get(s, {}) for s in suites)
                or all(str(value(args, flag.dest)) in _OWN_VALUES.get(s, {}).get(flag.dest, ())
                       for s in suites)):
            continue
        why = "; ".join(dict.fromkeys(_IGNORED[s][flag.dest] for s in suites))
        raise ValueError(f"{flag.name}{_shown(flag.dest, typed[flag.name])}: the "
                         f"{' and '.join(suites)} suite"
                         f"{'s do' if len(suites) > 1 else ' does'} not read it: {why}; drop it, "
                         f"or add a suite that reads it to --suites")


def _shown(dest: str, got: Any) -> str:
    """A given flag's value as an error shows it after the flag ("" for a switch)."""
    if got is True:
        return ""
    if isinstance(got, list):
        return " " + " ".join(map(str, got))
    return " " + (format_bytes(got, exact=True) if dest == "memory_budget" else str(got))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memfine bench`` flags (one per :class:`BenchOptions` field)."""
    add_flags(parser, _FLAGS)


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
    chosen = value(args, "suites") or ["all"]
    suites = SUITES if "all" in chosen else tuple(dict.fromkeys(chosen))
    quick = bool(value(args, "quick"))
    threads = _or(args, "threads", 1 if quick else None)
    if threads is not None and threads >= 1:  # below 1: BenchOptions names --threads
        threads = clamp_threads(threads)
    return _options(args, dict(
        suites=suites, configs=tuple(value(args, "configs") or ()),
        scale_down=value(args, "scale_down"), tokens=value(args, "tokens"),
        hidden_size=value(args, "hidden_size"),
        intermediate_size=value(args, "intermediate_size"),
        num_experts=value(args, "num_experts"), top_k=value(args, "top_k"),
        dtype=value(args, "dtype"), threads=threads,
        repeats=_or(args, "repeats", 1 if quick else 5),
        warmup=_or(args, "warmup", 0 if quick else 1), out=str(value(args, "out")), quick=quick,
        methods=tuple(value(args, "methods") or ()),
        budget_bytes=value(args, "memory_budget"),
        skew_levels=tuple(value(args, "skew_levels")), device=device.type,
        seed=value(args, "seed"), compile=bool(value(args, "compile")),
        compile_backend=value(args, "compile_backend"),
        count_device=value(args, "count_device")))


def _options(args: argparse.Namespace, fields: dict[str, Any]) -> BenchOptions:
    """``BenchOptions(**fields)``; an invalid field's error names its flag and value."""
    try:
        return BenchOptions(**fields)
    except ValueError as err:
        raise ValueError(name_flag(err, typed_fields(args, _FLAGS))) from err


def _or(args: argparse.Namespace, dest: str, default: int | None) -> int | None:
    """The flag's value, or ``default`` when it was not given."""
    got = value(args, dest)
    return default if got is None else got


_SIZE_FLAGS = {"tokens": "--tokens", "hidden_size": "--hidden-size",
               "intermediate_size": "--intermediate-size", "num_experts": "--num-experts"}


def _check_sizes_fit(opts: BenchOptions, device: torch.device) -> None:
    """Refuse given sizes whose layer cannot exist on ``device``, before anything is written.

    A lower bound from integer arithmetic (a size not given counts as 1): one layer's SwiGLU
    experts' weights (3·E·d·n) and one (T, d) input in ``--dtype``
    (:func:`memfine.memory.bounds.weights_and_inputs_lower_bound`).

    Raises:
        ValueError: naming the size flags given, the bytes needed and the bytes free.
    """
    from memfine.memory.bounds import weights_and_inputs_lower_bound
    from memfine.reports.memory_log import available_bytes
    from memfine.units import DTYPE_BYTES, format_bytes

    given = {f: getattr(opts, f) for f in _SIZE_FLAGS if getattr(opts, f) is not None}
    if not given:
        return
    T, D, N, E = (given.get(f, 1) for f in ("tokens", "hidden_size", "intermediate_size",
                                            "num_experts"))
    needed = weights_and_inputs_lower_bound(num_layers=1, num_experts=E, hidden_size=D,
                                            intermediate_size=N, tokens=T,
                                            dtype_bytes=DTYPE_BYTES[opts.dtype])
    free = available_bytes(device)
    if free is not None and needed > free:
        flags = ", ".join(f"{_SIZE_FLAGS[f]} {v}" for f, v in given.items())
        raise ValueError(f"{flags}: one layer of these sizes needs at least "
                         f"{format_bytes(needed)}, more than the {format_bytes(free)} free on "
                         f"{device}; lower them")


def _check_budget(opts: BenchOptions, device: torch.device) -> None:
    """Refuse a ``--memory-budget`` that a budgeted method's layer call cannot meet at any bin.

    The check of ``memfine train`` (:func:`memfine.flags.budget.layer_need`) at each point's
    MACT layer call, before anything runs; the point that needs the most is named.

    Raises:
        ValueError: one line naming ``--memory-budget``, the point and the smallest budget.
    """
    from memfine.flags.budget import layer_need
    from memfine.schedule.decision import InfeasibleBudgetError
    from memfine.units import DTYPE_BYTES

    if opts.budget_bytes is None:
        return
    for suite in opts.suites:
        calls: list[tuple[str, Any, Any, int]] = getattr(
            SUITE_MODULES[suite], "budget_calls", lambda *_: [])(
            opts, select_methods(suite, opts.methods, opts.compile))
        needs = [(layer_need(chunk, moe, T, DTYPE_BYTES[opts.dtype], device.type), point, chunk)
                 for point, moe, chunk, T in calls]
        if needs:
            (need, rows, least), point, chunk = max(needs, key=lambda n: n[0][0])
            if opts.budget_bytes < need:
                err = InfeasibleBudgetError(opts.budget_bytes, need, chunk.bins, (
                    f"{suite} {point}'s MoE layer call ({rows} rows) needs more at its best "
                    f"bin (c={least.num_chunks})"))
                raise ValueError(flag_words(str(err), _BUDGET_NAMES))


def run(args: argparse.Namespace) -> int:
    """Run the selected suites; print tables, write CSV, PNG and JSON.

    Returns:
        0, or 1 when any method failed (its error is printed in full after the tables).
    """
    device = _device(value(args, "device"))
    opts = options_from_args(args, device)
    _check_flags_read(args, opts.suites)
    check_bench_out(Path(opts.out), bool(value(args, "overwrite")))
    if not any(select_methods(s, opts.methods, opts.compile) for s in opts.suites):
        has = "; ".join(f"{s} has {', '.join(select_methods(s, (), True))}" for s in opts.suites)
        raise ValueError(f"--methods {' '.join(opts.methods)}: no method of the "
                         f"{' and '.join(opts.suites)} suite{'s' * (len(opts.suites) > 1)} ({has})"
                         f"; pick from those, or add to --suites a suite that has them")
    if opts.top_k is not None and opts.num_experts is not None and opts.top_k > opts.num_experts:
        raise ValueError(f"--top-k {opts.top_k} must be at most --num-experts {opts.num_experts}")
    _check_sizes_fit(opts, device)
    _check_budget(opts, device)
    failures = run_suites(opts, device)
    for failure in failures:
        print(f"memfine bench: method failed: {flag_words(failure, _BUDGET_NAMES)}",
              file=sys.stderr)
    return 1 if failures else 0

