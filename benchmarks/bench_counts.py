"""``memfine bench --suites counts`` as a script: ATen ops, host syncs and ``_grouped_mm`` calls.

Counts one MoE layer's forward + backward per method (memfine fused, one backward block, chunked,
MACT, a torchtitan-style grouped_mm layer, memfine's plain grouped_mm path, transformers'
grouped_mm and memfine's transformers backend) at the Qwen3-30B-A3B layer preset (T 4096 and
16384) and the DeepSeek-V3 one (T 4096), bf16, d and n divided by 16 with the real dims' backward
block rows (:mod:`memfine.suites.counts`).

Output: ``bench_counts.csv`` (docs/style.md §6 columns; units ops, syncs, calls, chunks) and
``bench_config.json`` in ``--out`` (default ``benchmarks/results/counts``; existing ``bench_*``
files there are kept unless ``--overwrite``).
Usage: ``python benchmarks/bench_counts.py [--quick] [--tokens T] [--count-device cuda|cpu]
[--out DIR] [--overwrite]``.
"""

from __future__ import annotations

from pathlib import Path

from memfine.suites.runner import script_main

if __name__ == "__main__":
    raise SystemExit(script_main("counts", Path(__file__).parent / "results" / "counts"))
