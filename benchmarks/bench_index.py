"""Routing-index builders: sort-free (dense T×E map, MoEBlaze §3) vs argsort, build time.

For each (T, E, k) the two builders (and ``auto``, which picks by the dense map size T·E against
``memfine.dispatch.index.SORT_FREE_MAX_CELLS``) run interleaved on the same random routing through
the shared harness (:func:`memfine.bench.harness.run_methods`, the build as the forward, no
backward); rows report p20/p50/p80 build time in ms (mode ``fwd``) per method. The CSV uses the
docs/style.md §6 columns (:func:`memfine.bench.results.csv_row`).

Usage: ``python benchmarks/bench_index.py [--reps 15] [--out PATH]``.
Legend: T tokens, E experts, K top-k slots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from memfine.bench.harness import Method, run_methods
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.dispatch import build_index_argsort, build_index_sort_free, build_routing_index
from memfine.dispatch.index import SORT_FREE_MAX_CELLS

BENCHMARK = "index_build"
BUILDERS = {
    "sort_free": build_index_sort_free,
    "argsort": build_index_argsort,
    "auto": build_routing_index,
}
# (T, E, k): small and large token counts, few and many experts (docs/design.md §3, §7 configs).
GRID = [(1024, 8, 2), (8192, 16, 4), (65536, 16, 4), (4096, 64, 8), (16384, 128, 8),
        (16384, 256, 8), (65536, 256, 8)]


def time_builders(T: int, E: int, k: int, reps: int, warmup: int = 2
                  ) -> dict[str, tuple[float, float, float]]:
    """(p20, p50, p80) build times in ms of every builder on one random (T, k) routing."""
    top_k_index = torch.rand(T, E).topk(k, dim=-1).indices
    methods = [Method(name=name, forward=lambda build=build: build(top_k_index, E),
                      backward=lambda index: None) for name, build in BUILDERS.items()]
    results = run_methods(methods, repeats=reps, warmup=warmup, measure=False)
    return {res.name: res.time_ms("fwd") for res in results}  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    """Run the grid; print a table and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per builder")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "bench_index_cpu.csv")
    args = parser.parse_args(argv)
    env, rows = collect_environment("cpu"), []
    print(f"auto: sort-free while T·E <= {SORT_FREE_MAX_CELLS} cells")
    print(f"{'T':>6} {'E':>4} {'k':>2} {'T·E':>9} | "
          + " | ".join(f"{name:>9} p50 ms" for name in BUILDERS) + " | argsort/sort_free")
    for T, E, k in GRID:
        times = time_builders(T, E, k, args.reps)
        p50 = {name: t[1] for name, t in times.items()}
        print(f"{T:>6} {E:>4} {k:>2} {T * E:>9} | "
              + " | ".join(f"{p50[name]:>16.3f}" for name in BUILDERS)
              + f" | {p50['argsort'] / p50['sort_free']:>6.2f}")
        config = {"num_tokens": T, "num_experts": E, "top_k": k,
                  "sort_free_max_cells": SORT_FREE_MAX_CELLS}
        rows += [csv_row(benchmark=BENCHMARK, method=name, mode="fwd", metric="time",
                         unit="ms", x_name="dense_map_cells", x_value=T * E, values=t,
                         config=config, env=env) for name, t in times.items()]
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
