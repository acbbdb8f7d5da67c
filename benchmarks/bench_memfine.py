"""MemFine's four-way comparison as routing skew grows: full recompute, c = 8, MACT, none.

A thin script over the ``chunking`` suite (:mod:`memfine.suites.chunking`, run by
:func:`memfine.suites.runner.script_main`; ``memfine bench --suites chunking`` is the same with
every flag): one MoE layer (d 256, n 512, E 8, k 2) whose experts receive σ ∈ {1, 2, 4, 8} times
their balanced share of rows, MACT's budget the least that holds σ = 8 with c = 8; peak live
bytes, saved bytes and forward + backward time of each method, interleaved, one torch thread.
``benchmarks/bench_ep.py`` measures the same under expert parallelism with real ranks.

Output: ``bench_chunking.csv`` (docs/style.md §6 columns) and
``bench_chunking_{time,memory,predicted,skew}.png`` in ``--out`` (default
``benchmarks/results``).
Usage: ``python benchmarks/bench_memfine.py [--repeats 5] [--quick] [--out DIR] [--overwrite]``
(existing ``bench_*`` files in ``--out`` are kept unless ``--overwrite``).
Reference: MemFine (arXiv 2511.21431) §4, Table 4.
"""

from __future__ import annotations

from pathlib import Path

from memfine.suites.runner import script_main

if __name__ == "__main__":
    raise SystemExit(script_main("chunking", Path(__file__).parent / "results"))
