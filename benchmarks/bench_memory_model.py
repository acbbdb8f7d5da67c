"""The MoE-layer memory model next to measurement: saved and peak bytes, predicted vs measured.

For every layer configuration of the grid (fp32/bf16, k ∈ {1, 2, 8}, E up to 64, balanced and
fully skewed routing) and every execution mode (``plain``, ``fused``, ``full`` recompute, and
``chunked`` with c ∈ {2, 4, 8}), one :class:`memfine.nn.MoELayer` forward + backward is measured
with the shared harness (:mod:`memfine.bench.harness`: saved-tensor hooks for the saved bytes,
the CPU live-storage tracker for the peak) and set next to
:func:`memfine.memory.layer.moe_layer_memory`.

Protocol (the model's): x exists before and requires grad; parameters have no ``.grad`` before a
call; out and the two aux losses get gradients that exist before. Skewed routing sends every
token to experts 0..k-1 (the router's selection-bias knob ``skew_hot_experts``/``skew_bias``).

Output: the table on stdout; ``benchmarks/results/memory_model_cpu.csv`` (docs/style.md §6 columns:
``saved_bytes``/``peak_bytes`` measured, ``*_predicted`` and ``*_predicted_over_measured``;
``x_name`` = ``config``, ``method`` = the mode) and a PNG of predicted against measured bytes.

The run uses one torch intra-op thread, so the CSV's ``time`` rows (one call per method, no
warm-up: a by-product of the memory calls, not a speed comparison) are the calling thread's CPU
time, named in ``config_json`` as ``"clock": "thread_cpu"``.

Usage: ``python benchmarks/bench_memory_model.py [--out benchmarks/results/memory_model_cpu.csv]``
Legend: T tokens, D = d, N = n, E experts, K = k.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

from memfine._optional import pyplot
from memfine.baselines.layers import layer_method
from memfine.bench.harness import Method, run_methods
from memfine.bench.results import collect_environment, result_rows, write_csv
from memfine.config import ChunkConfig, MoEConfig
from memfine.measure.report import compare, format_table
from memfine.memory.layer import mode_settings
from memfine.nn import MoELayer

BENCHMARK = "memory_model"
MODES = (("plain", 1), ("fused", 1), ("full", 1), ("chunked", 2), ("chunked", 4),
         ("chunked", 8))
# (dtype, T, D, N, E, K, skewed); bf16 sizes stay small (bf16 matmuls are slow on this CPU).
GRID = (
    (torch.float32, 512, 64, 128, 8, 2, False),
    (torch.float32, 512, 64, 128, 8, 2, True),
    (torch.float32, 256, 64, 64, 64, 8, False),
    (torch.float32, 256, 64, 64, 64, 8, True),
    (torch.float32, 512, 128, 64, 16, 1, False),
    (torch.bfloat16, 64, 32, 32, 8, 2, False),
    (torch.bfloat16, 64, 32, 32, 8, 2, True),
    (torch.bfloat16, 64, 32, 16, 64, 8, True),
)


def _method(moe: MoEConfig, T: int, dtype: torch.dtype, mode: str, c: int) -> Method:
    """A harness method running one MoELayer forward + backward in ``mode`` (the model's
    protocol and prediction: :func:`memfine.baselines.layers.layer_method`)."""
    impl, num_chunks, recompute = mode_settings(mode, c)
    moe = dataclasses.replace(moe, experts_impl=impl)
    layer = MoELayer(moe, chunk=ChunkConfig(num_chunks=num_chunks, recompute=recompute))
    layer = layer.to(dtype)
    x_TD = torch.randn(T, moe.hidden_size, dtype=dtype, requires_grad=True)
    grad_TD = torch.randn(T, moe.hidden_size, dtype=dtype)
    return layer_method(mode if mode != "chunked" else f"chunked_c{c}", layer, x_TD, grad_TD)


def _label(dtype: torch.dtype, T: int, D: int, N: int, E: int, K: int, skewed: bool) -> str:
    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    return f"{kind}-T{T}-d{D}-n{N}-E{E}-k{K}-{'skewed' if skewed else 'balanced'}"


def _plot(points: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, item in zip(axes, ("saved_bytes", "peak_bytes"), strict=True):
        for mode in sorted({p["mode"] for p in points}):
            sel = [p for p in points if p["mode"] == mode]
            ax.scatter([p[f"{item}_measured"] / 2**20 for p in sel],
                       [p[f"{item}_predicted"] / 2**20 for p in sel], label=mode, s=18)
        lo = min(min(p[f"{item}_measured"], p[f"{item}_predicted"]) for p in points) / 2**20
        hi = max(max(p[f"{item}_measured"], p[f"{item}_predicted"]) for p in points) / 2**20
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {item.replace('_bytes', '')} (MiB)")
        ax.set_ylabel(f"predicted {item.replace('_bytes', '')} (MiB)")
        ax.set_title(f"MoE layer {item.replace('_bytes', '')} bytes, {len(points)} points")
        ax.legend(fontsize=7)
    fig.suptitle("memfine memory model vs measurement (CPU storage tracker, saved-tensor hooks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Run the grid, print the table, write the CSV and the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/memory_model_cpu.csv",
                        help="CSV path (the PNG goes next to it)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the times (a by-product) are then thread CPU time
    torch.manual_seed(0)
    env = collect_environment("cpu")
    rows, points = [], []
    for dtype, T, D, N, E, K, skewed in GRID:
        moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K,
                        renormalize=K > 1, skew_hot_experts=K if skewed else 0,
                        skew_bias=100.0 if skewed else 0.0)
        label = _label(dtype, T, D, N, E, K, skewed)
        methods = [_method(moe, T, dtype, mode, c) for mode, c in MODES]
        results = run_methods(methods, repeats=1, warmup=0)
        config = {"dtype": str(dtype), "T": T, "d": D, "n": N, "E": E, "k": K,
                  "routing": "skewed" if skewed else "balanced"}
        rows += result_rows(results, benchmark=BENCHMARK, x_name="config", x_value=label,
                            config=config, env=env)
        print(f"\n{label}")
        for res in results:
            if res.error:
                print(f"  {res.name}: {res.error}")
                continue
            table = compare({f"{res.name} saved": res.predicted["saved_bytes"] or 0,
                             f"{res.name} peak": res.predicted["peak_bytes"] or 0},
                            {f"{res.name} saved": res.saved_bytes,
                             f"{res.name} peak": res.peak_bytes})
            print("\n".join(format_table(table).splitlines()[1:]))
            points.append({"mode": res.name, "label": label,
                           "saved_bytes_measured": res.saved_bytes,
                           "saved_bytes_predicted": res.predicted["saved_bytes"],
                           "peak_bytes_measured": res.peak_bytes,
                           "peak_bytes_predicted": res.predicted["peak_bytes"]})
    out = write_csv(rows, args.out)
    _plot(points, out.with_suffix(".png"))
    exact = sum(p["saved_bytes_measured"] == p["saved_bytes_predicted"] for p in points)
    worst = max(abs(p["peak_bytes_predicted"] / p["peak_bytes_measured"] - 1) for p in points)
    print(f"\n{len(points)} points: saved bytes exact in {exact}; worst peak error "
          f"{100 * worst:.3f}%; wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
