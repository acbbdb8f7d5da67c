"""Training step of the small MoE language model: time and memory of memfine's paths.

A thin script over the ``model`` suite (:mod:`memfine.suites.model`, run by
:func:`memfine.suites.runner.script_main`; ``memfine bench --suites model`` is the same with every
flag): methods ``plain``, ``fused``, ``fused_mact`` and ``full_recompute`` on the ``small``
training preset (d 128, n 128, E 8, k 2, 4 layers, 32 × 128 tokens per step), interleaved, after
warm-up, one torch thread.

Output: ``bench_model.csv`` (docs/style.md §6 columns) and ``bench_model_{time,memory}.png`` in
``--out`` (default ``benchmarks/results``).
Usage: ``python benchmarks/bench_model.py [--repeats 5] [--quick] [--out DIR] [--overwrite]``
(existing ``bench_*`` files in ``--out`` are kept unless ``--overwrite``).
"""

from __future__ import annotations

from pathlib import Path

from memfine.suites.runner import script_main

if __name__ == "__main__":
    raise SystemExit(script_main("model", Path(__file__).parent / "results"))
