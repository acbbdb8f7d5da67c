"""Training step of the small MoE language model: time and memory of memfine's paths.

A thin script over ``memfine bench --suites model`` (the suite lives in
:mod:`memfine.bench.suite_model`; the measurements in :mod:`memfine.bench.harness`):
methods ``plain``, ``fused``, ``fused_mact`` and ``full_recompute`` on the ``small`` training
preset (d 128, n 128, E 8, k 2, 4 layers, 32 × 128 tokens per step), interleaved, after warm-up.

Output: ``bench_model.csv`` (docs/style.md §6 columns) and ``bench_model_{time,memory}.png`` in
``--out`` (default ``benchmarks/results``).
Usage: ``python benchmarks/bench_model.py [--repeats 5] [--quick] [--out DIR] [...]``; every
``memfine bench`` flag is accepted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memfine.cli.main import main

RESULTS = Path(__file__).parent / "results"

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", str(RESULTS)]
    raise SystemExit(main(["bench", "--suites", "model", *args]))
