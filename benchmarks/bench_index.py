"""Routing-index builders: sort-free (dense T×E map, MoEBlaze §3) vs argsort, build time.

For each (T, E, k) the two builders (and ``auto``, which picks by the dense map size T·E
against ``memfine.dispatch.sort_free_max_cells("cpu")``, the rule these rows set) run
interleaved on the same random routing through the shared harness
(:func:`memfine.bench.harness.run_methods`, the build as the forward, no backward), timed with
the calling thread's CPU time (``time.thread_time``) at one torch intra-op thread
(``--threads 1``, the default; the wall clock at more threads); rows report p20/p50/p80 build
time in ms (mode ``fwd``) per method and ``time_ratio_to_sort_free``, the quantiles over rounds
of the build time ÷ sort_free's in the same round; ``config_json`` names the ``clock``, the
``rounds`` and the 1-minute load average. The CSV uses the docs/style.md §6 columns
(:func:`memfine.bench.results.csv_row`).

Usage: ``python benchmarks/bench_index.py [--reps 15] [--threads 1] [--out PATH]``.
Legend: T tokens, E experts, K top-k slots.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from memfine.bench.harness import Method, MethodResult, round_ratios, run_methods
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.dispatch import (
    build_index_argsort,
    build_index_sort_free,
    build_routing_index,
    sort_free_max_cells,
)
from memfine.train.loop import torch_threads

BENCHMARK = "index_build"
BUILDERS = {
    "sort_free": build_index_sort_free,
    "argsort": build_index_argsort,
    "auto": build_routing_index,
}
# (T, E, k): small and large token counts, few and many experts (docs/design.md §3, §7 configs).
GRID = [(1024, 8, 2), (2048, 16, 4), (4096, 16, 4), (8192, 16, 4), (65536, 16, 4),
        (4096, 64, 8), (16384, 128, 8), (16384, 256, 8), (65536, 256, 8)]


def time_builders(T: int, E: int, k: int, reps: int, warmup: int = 2) -> list[MethodResult]:
    """Every builder's timed builds on one random (T, k) routing, interleaved."""
    top_k_index = torch.rand(T, E).topk(k, dim=-1).indices
    methods = [Method(name=name, forward=lambda build=build: build(top_k_index, E),
                      backward=lambda index: None) for name, build in BUILDERS.items()]
    return run_methods(methods, repeats=reps, warmup=warmup, measure=False)


def main(argv: list[str] | None = None) -> int:
    """Run the grid; print a table and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per builder")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: thread CPU time; more: the wall clock)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "bench_index_cpu.csv")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    with torch_threads(args.threads):
        rows = run_grid(args.reps)
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


def run_grid(reps: int) -> list[dict[str, str]]:
    """Time every grid point; print a table; return the CSV rows."""
    env, rows = collect_environment("cpu"), []
    print(f"auto: sort-free while T·E <= {sort_free_max_cells('cpu')} cells")
    print(f"{'T':>6} {'E':>4} {'k':>2} {'T·E':>9} | "
          + " | ".join(f"{name:>9} p50 ms" for name in BUILDERS) + " | argsort/sort_free")
    for T, E, k in GRID:
        results = {res.name: res for res in time_builders(T, E, k, reps)}
        p50 = {name: res.time_ms("fwd")[1] for name, res in results.items()}  # type: ignore[index]
        ratio = round_ratios(results["argsort"], results["sort_free"], "fwd")
        print(f"{T:>6} {E:>4} {k:>2} {T * E:>9} | "
              + " | ".join(f"{p50[name]:>16.3f}" for name in BUILDERS)
              + f" | {ratio[1] if ratio else float('nan'):>6.2f}")
        for name, res in results.items():
            config = {"num_tokens": T, "num_experts": E, "top_k": k,
                      "sort_free_max_cells": sort_free_max_cells("cpu"), "clock": res.clock,
                      "rounds": len(res.times_s["fwd"]),
                      "load_average_1min": round(os.getloadavg()[0], 2)}
            point = {"benchmark": BENCHMARK, "method": name, "mode": "fwd",
                     "x_name": "dense_map_cells", "x_value": T * E, "config": config, "env": env}
            rows += [csv_row(metric="time", unit="ms", values=res.time_ms("fwd"), **point),
                     csv_row(metric="time_ratio_to_sort_free", unit="ratio",
                             values=round_ratios(res, results["sort_free"], "fwd"), **point)]
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
