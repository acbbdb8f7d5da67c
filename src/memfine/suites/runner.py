"""Run suites end to end: tables as points finish, ``bench_<suite>.csv``, PNGs, the run's JSON.

:func:`run_suites` is what ``memfine bench`` and the scripts in ``benchmarks/`` call; a script is
:func:`script_main` with its suite name (a few flags; the full set is ``memfine bench``'s, whose
table takes the rows shared with the scripts from here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from memfine.artifacts.rundir import check_bench_out
from memfine.bench.options import COUNT_DEVICES, BenchOptions, Point, bench_device
from memfine.bench.output import plot_points, print_point
from memfine.bench.results import point_rows, write_csv, write_run_config
from memfine.bench.verdicts import verdict_lines
from memfine.environment import collect_environment
from memfine.flags.table import Flag, NotGiven, add_flags, value
from memfine.flags.threads import clamp_threads
from memfine.flags.values import int_at_least
from memfine.suites import SUITE_MODULES, select_methods
from memfine.train.loop import torch_threads

TOKENS = Flag("--tokens", ("tokens",), "T, tokens per layer call (model: per step)",
              default=NotGiven(text="the shape's"))
COUNT_DEVICE = Flag("--count-device", ("count_device",), "counts suite: the device whose code "
                    "path is counted (its row blocks and combine), counted on the CPU", str,
                    COUNT_DEVICES, NotGiven("cuda"))
OVERWRITE = Flag("--overwrite", (), "replace the results of an earlier run in --out (without it, "
                 "any bench_* file there stops the run)", action="store_true",
                 default=NotGiven(False))
SUITE_FLAGS = {"counts": (TOKENS, COUNT_DEVICE)}
"""``memfine bench``'s rows that a suite's script takes too, beyond its own few."""


def run_suites(opts: BenchOptions, device: torch.device) -> list[str]:
    """Run each suite: tables, CSV, PNGs; ``bench_config.json`` written with the first point.

    The options printed and written record the dtype that ran: a suite's own ``DTYPE`` (counts:
    bfloat16) when every selected suite has that one, else ``opts.dtype``.

    Each point's CSV rows carry, in ``config_json``, the clock that timed each method
    (``clock``), its timed rounds (``rounds``) and the 1-minute load average when the point
    finished (``load_average_1min``), plus ``time_ratio_to_<reference>`` rows: per-round ratios to
    the point's reference method (:func:`memfine.bench.results.point_rows`).

    Args:
        opts: the resolved options (``opts.out`` is the output folder; created; the files an
            earlier run wrote there under the same names are replaced, ``--overwrite``).
        device: where the methods run.

    Returns:
        One ``"<suite> <point> <method>: <error>"`` line per method that raised.

    Side effects: sets torch's intra-op threads to ``opts.threads`` for the run (restored).
    """
    with torch_threads(opts.threads):
        return _run(opts, device)


def _run(opts: BenchOptions, device: torch.device) -> list[str]:
    failures: list[str] = []
    out = Path(opts.out)
    env = collect_environment(device)
    config_written = False  # this run's, even over an earlier run's (--overwrite)
    for suite in opts.suites:  # a bad shape (k above E, --tokens) is one error, nothing printed
        SUITE_MODULES[suite].shapes(opts)
    options = opts.to_dict()  # the dtype that ran: a suite's own (counts: bf16) when alone
    ran = {str(getattr(SUITE_MODULES[s], "DTYPE", opts.torch_dtype)) for s in opts.suites}
    options["dtype"] = ran.pop().removeprefix("torch.") if len(ran) == 1 else opts.dtype
    print("memfine bench " + json.dumps(options, sort_keys=True))
    for suite in opts.suites:
        names = select_methods(suite, opts.methods, opts.compile)
        if not names:
            print(f"{suite}: skipped: none of --methods belongs to this suite")
            continue
        start = time.perf_counter()
        points: list[Point] = []
        rows: list[dict[str, str]] = []
        module = SUITE_MODULES[suite]  # a suite may print and write its own rows (counts)
        for point in module.run(opts, device, names):
            if not config_written:  # with the first point: a suite's bad shape writes nothing
                write_run_config(options, env, out)
                config_written = True
            getattr(module, "print_point", print_point)(point)
            points.append(point)
            failures += [f"{suite} {point.x_value} {res.name}: {res.error}"
                         for res in point.results if res.error]
            rows += (module.csv_rows(point, env) if hasattr(module, "csv_rows") else
                     point_rows(point, env))
        if not points:
            continue
        print("\n".join(verdict_lines(suite, points)))
        plots = [] if hasattr(module, "csv_rows") else plot_points(points, out, suite)
        written = [write_csv(rows, out / f"bench_{suite}.csv"), *plots]
        print(f"{suite}: {time.perf_counter() - start:.1f} s; wrote "
              + ", ".join(str(p) for p in written))
    print(f"environment: {env.line()}")
    return failures


def script_main(suite: str, out: Path, argv: Sequence[str] | None = None) -> int:
    """A ``benchmarks/`` script: run one suite and write its files to ``out``.

    Flags: ``--repeats``, ``--warmup``, ``--threads`` (default 1), ``--quick``, ``--out``,
    ``--overwrite`` (as ``memfine bench``), ``--device`` (default ``cpu``;
    ``cuda`` times with CUDA events and reads allocator peaks), and the suite's
    :data:`SUITE_FLAGS` (counts: ``--tokens``, ``--count-device``).

    Returns:
        0, or 1 when a method failed (its error is printed).

    Raises:
        SystemExit: 2 (one usage error naming the flag) on a bad flag value or ``--device``, a
            ``--tokens`` the suite's shapes refuse, or an ``--out`` that
            :func:`memfine.artifacts.rundir.check_bench_out` refuses.
    """
    parser = argparse.ArgumentParser(description=f"memfine bench --suites {suite}")
    parser.add_argument("--repeats", type=int_at_least(1), default=5,
                        help="timed rounds per method, >= 1")
    parser.add_argument("--warmup", type=int_at_least(0), default=1,
                        help="untimed rounds first, >= 0")
    parser.add_argument("--threads", type=int_at_least(1), default=1,
                        help="torch intra-op threads, >= 1; more than this process's CPUs is "
                             "lowered to them with a warning")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--out", type=Path, default=out, help="output folder")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda[:i] or auto (CUDA when present); default cpu")
    add_flags(parser, (OVERWRITE, *SUITE_FLAGS.get(suite, ())))
    args = parser.parse_args(argv)
    try:
        device = bench_device(args.device)
        opts = BenchOptions(suites=(suite,), repeats=1 if args.quick else args.repeats,
                            warmup=0 if args.quick else args.warmup,
                            threads=clamp_threads(args.threads), quick=args.quick,
                            out=str(args.out), device=device.type,
                            **{f.dest: value(args, f.dest) for f in SUITE_FLAGS.get(suite, ())})
        SUITE_MODULES[suite].shapes(opts)
        check_bench_out(args.out, value(args, "overwrite"))
    except ValueError as err:
        parser.error(str(err))
    failures = run_suites(opts, device)
    for failure in failures:
        print(f"method failed: {failure}", file=sys.stderr)
    return 1 if failures else 0
