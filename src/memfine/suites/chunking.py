"""``chunking`` suite: MemFine's methods on one MoE layer as the received rows grow with skew.

Skew emulation on one device: with expert parallelism, routing skew makes one rank's experts
receive s″ = σ × its balanced share of rows (MemFine observed σ ≈ 32 early in training). On one
device every routed row is local, so the suite feeds the layer σ·T tokens: its experts then
receive σ·T·k rows, as the hot rank's do. (The router's tensors grow with σ here too; on a real
rank they stay at T. ``benchmarks/bench_ep.py`` measures the multi-process case.)

Methods (memfine's fused expert path in every case; same weights at every level):

- ``full_recompute``: no chunks, the layer recomputed in backward (MemFine's baseline (1));
- ``fixed_c8``: c = 8 chunks with per-chunk recompute (MemFine (2));
- ``mact``: c chosen per call from the received rows and a byte budget (MemFine (3), Eq. 8-9);
  the automatic budget is the least one that holds the worst level with c = 8 (the largest
  bin), so c grows 1 → 8 with σ and the peak stays under the budget;
- ``no_recompute``: no chunks, no recompute.

Shape: ``skew_demo`` (d 256, n 512, E 8, k 2, T 1024 tokens at σ = 1, levels σ ∈ {1, 2, 4, 8}):
small weights and many tokens, so that activations rather than the weights' gradients dominate
the peak, as at the papers' token counts. ``--configs`` / explicit sizes replace it.
Legend: T tokens, D = d.
Reference: MemFine (arXiv 2511.21431) §4, Table 4, Eq. 8-9; docs/design.md §4.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

from memfine.baselines.layers import (
    add_ratios,
    base_layer,
    budget_for_rows,
    layer_inputs,
    layer_method,
    sharing,
)
from memfine.bench.harness import run_methods
from memfine.bench.options import (
    BenchOptions,
    LayerShape,
    Point,
    announce,
    resolve_shapes,
)
from memfine.config import ChunkConfig, MoEConfig
from memfine.suites.experts import moe_config
from memfine.units import format_bytes

NAME = "chunking"
METHODS = ("full_recompute", "fixed_c8", "mact", "no_recompute")
REFERENCE = "full_recompute"
# Default shape: small d, E and a large T, so that activations (not the weights and their
# gradients) dominate the peak on a CPU, as they do at the papers' token counts.
SKEW_DEMO = LayerShape(name="skew_demo", tokens=1024, hidden_size=256, intermediate_size=512,
                       num_experts=8, top_k=2)
QUICK = LayerShape(name="quick", tokens=32, hidden_size=64, intermediate_size=128,
                   num_experts=4, top_k=2)
BINS = (1, 2, 4, 8)


def chunk_configs(budget: int) -> dict[str, ChunkConfig]:
    """The chunk config of every method."""
    return {
        "full_recompute": ChunkConfig(num_chunks=1, recompute="full"),
        "fixed_c8": ChunkConfig(num_chunks=8, recompute="experts"),
        "mact": ChunkConfig(memory_budget_bytes=budget, bins=BINS, recompute="experts"),
        "no_recompute": ChunkConfig(num_chunks=1, recompute="none"),
    }


def shapes(opts: BenchOptions) -> list[LayerShape]:
    """The suite's shapes, resolved by the runner before its first line (k > E raises)."""
    return resolve_shapes(opts, [SKEW_DEMO], QUICK)


def budget_calls(opts: BenchOptions, names: tuple[str, ...]
                 ) -> list[tuple[str, MoEConfig, ChunkConfig, int]]:
    """(point, MoE config, chunk config, T) of each ``--memory-budget`` layer call to run."""
    if "mact" not in names or opts.budget_bytes is None:
        return []
    shape, mact = shapes(opts)[0], chunk_configs(opts.budget_bytes)["mact"]
    return [(f"skew {s}x", moe_config(shape), mact, shape.tokens * s) for s in opts.skew_levels]


def run(opts: BenchOptions, device: torch.device, names: tuple[str, ...]
        ) -> Iterator[Point]:
    """Run the suite: one point per skew level σ (the first selected shape only)."""
    found = shapes(opts)
    if len(found) > 1:
        print(f"chunking: runs the first shape only ({found[0].name})")
    shape = found[0]
    moe = moe_config(shape)
    dtype = opts.torch_dtype
    dt = torch.empty((), dtype=dtype).element_size()
    worst_tokens = shape.tokens * opts.skew_levels[-1]
    budget = opts.budget_bytes or budget_for_rows(
        moe, worst_tokens, dt, math.ceil(worst_tokens * moe.top_k / BINS[-1]), device.type)
    base = base_layer(moe, dtype=dtype, device=device, seed=opts.seed)
    chunks = chunk_configs(budget)
    for skew in opts.skew_levels:
        level = dataclasses.replace(shape, tokens=shape.tokens * skew, paper_tokens=None)
        announce(NAME, f"skew {skew}x: {level.label()}", opts, len(names))
        x_TD, grad_TD = layer_inputs(level, dtype=dtype, device=device, seed=opts.seed)
        methods = [layer_method(name, sharing(base, moe, chunk=chunks[name]), x_TD, grad_TD,
                                budget_bytes=budget if name == "mact" else None)
                   for name in names]
        results = run_methods(methods, repeats=opts.repeats, warmup=opts.warmup, device=device)
        add_ratios(results, budget_bytes=dict.fromkeys(names, budget))
        rows = level.tokens * level.top_k
        for res in results:
            res.extras["recv_rows"] = (rows, "rows")
        config = {**level.to_dict(), "base_tokens": shape.tokens, "skew": skew,
                  "dtype": opts.dtype, "budget_bytes": budget, "bins": list(BINS),
                  "scale_down": opts.scale_down}
        label = (f"skew {skew}x: {level.label()} {opts.dtype}; s''={rows} rows; MACT budget "
                 f"{format_bytes(budget)}")
        yield Point(suite=NAME, x_name="skew", x_value=str(skew), label=label,
                    config=config, results=results, reference=REFERENCE)
