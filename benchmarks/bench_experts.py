"""One MoE layer on MoEBlaze Table 1 shapes: memfine fused against what people use today.

A thin script over the ``experts`` suite (:mod:`memfine.suites.experts`; the Table 1 rows
are :data:`memfine.bench.options.TABLE1`, run by :func:`memfine.suites.runner.script_main`;
``memfine bench --suites experts`` is the same with every flag): methods ``plain``,
``expert_loop``, ``grouped_mm``, ``fused``, ``fused_mact`` and ``full_recompute`` on Table 1 rows
1, 2, 3 and 5 with batch × seq divided by 256, interleaved, after warm-up, one torch thread.

Output: ``bench_experts.csv`` (docs/style.md §6 columns) and
``bench_experts_{time,memory,predicted}.png`` in ``--out`` (default ``benchmarks/results``).
Usage: ``python benchmarks/bench_experts.py [--repeats 5] [--quick] [--out DIR] [--overwrite]``
(existing ``bench_*`` files in ``--out`` are kept unless ``--overwrite``).
"""

from __future__ import annotations

from pathlib import Path

from memfine.suites.runner import script_main

if __name__ == "__main__":
    raise SystemExit(script_main("experts", Path(__file__).parent / "results"))
