"""transformers experts block: fwd+bwd time and saved bytes, "memfine" vs "eager" vs "grouped_mm".

One ``Qwen3MoeExperts`` module (transformers' own class, random weights) is called through its
experts interface with each implementation, on the same hidden states, routing and incoming
gradient:
- ``hf_eager``: transformers' per-expert loop (``experts_implementation="eager"``);
- ``hf_grouped_mm``: transformers' sort + ``torch._grouped_mm`` path (its CPU default);
- ``memfine``: ``experts_implementation="memfine"`` (fused MoEBlaze path, saves x + H);
- ``memfine_c4``: the same with 4 token chunks and per-chunk recompute (saves x + routing).
The routing (top-k of a softmax over random logits; weights require grad, as a router's do) is
outside the timed region; the index build of memfine and the sort of grouped_mm are inside. The
module, inputs and methods are those of ``memfine bench --suites hf``
(:mod:`memfine.suites.hf`), run by the shared harness
(:func:`memfine.bench.harness.run_methods`).

Configurations (Qwen3-MoE-shaped, fp32): ``tiny`` (d 128, n 64, E 8, k 2, T 512) and ``mid``
(Qwen3-30B-A3B's k 8 and n/d ratio at reduced size: d 768, n 256, E 32, k 8, T 512). Providers run
interleaved, rotating the order, so load changes on a shared machine hit all of them alike.
Times are the calling thread's CPU time (``time.thread_time``) at one torch intra-op thread
(``--threads 1``, the default), which other processes on a shared machine do not inflate; with
more threads the harness times with the wall clock and the CSV says so
(:func:`memfine.bench.harness.cpu_clock`).

Output: a printed table (``memfine bench``'s, ratios against ``memfine``), a CSV (docs/style.md §6
columns, :mod:`memfine.bench.results`; metrics ``time`` ms p20/p50/p80 with modes ``fwd``,
``bwd`` and ``full`` = forward + backward, ``time_ratio_to_memfine`` (p20/p50/p80 over the rounds
of the method's time ÷ memfine's in the same round), ``tokens_per_s``, ``saved_bytes`` and
``peak_bytes`` in bytes, ``saved_over_floor`` ratio with floor = (T·d + T·k·2n) elements, the
x + H floor of docs/design.md §5; ``config_json`` holds the ``clock``, the ``rounds`` and the
1-minute ``load_average_1min`` when the config finished; a failing method is printed and left
out) and a PNG of p50 time and saved bytes.

Usage: ``python benchmarks/bench_hf.py [--configs tiny mid] [--reps 5] [--threads 1]
[--out PATH]``.
Legend: T tokens, K top-k slots, E experts, D = d, N = n.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from memfine._optional import pyplot
from memfine.baselines.layers import add_ratios
from memfine.bench.harness import CLOCKS, MethodResult, run_methods
from memfine.bench.options import BenchOptions, LayerShape, Point
from memfine.bench.output import print_point
from memfine.bench.results import collect_environment, point_rows, write_csv
from memfine.integrations.transformers import register as register_memfine
from memfine.suites import hf
from memfine.train.loop import torch_threads
from memfine.units import format_bytes

BENCHMARK = "hf_experts"
RESULTS = Path(__file__).parent / "results"
CONFIGS = {
    "tiny": LayerShape(name="tiny", tokens=512, hidden_size=128, intermediate_size=64,
                       num_experts=8, top_k=2),
    "mid": LayerShape(name="mid", tokens=512, hidden_size=768, intermediate_size=256,
                      num_experts=32, top_k=8),
}
METHODS = hf.METHODS
OPTIONS = BenchOptions(suites=("hf",), dtype="float32", seed=0)  # dtype and seeds of the suite


def bench_config(shape: LayerShape, names: list[str], reps: int, warmup: int
                 ) -> list[MethodResult]:
    """Saved bytes and interleaved fwd+bwd times of every method (a failing one is recorded)."""
    device = torch.device("cpu")
    experts = hf.make_experts(shape, OPTIONS, device)
    methods = hf.build_methods(experts, hf.make_inputs(shape, OPTIONS, device), tuple(names))
    results = run_methods(methods, repeats=reps, warmup=warmup, device=device)
    add_ratios(results, floor_bytes=shape.floor_bytes(4))
    return results


def plot(rows: list[dict[str, str]], path: Path) -> None:
    """Bar charts of p50 time and saved MiB per configuration and method."""
    plt = pyplot()

    configs = list(dict.fromkeys(r["x_value"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = ((axes[0], "time", "full", 1.0, "fwd+bwd p50 (ms)"),
              (axes[1], "saved_bytes", "fwd", 2.0**-20, "saved for backward (MiB)"))
    for ax, metric, mode, scale, label in panels:
        width = 0.8 / len(methods)
        for i, prov in enumerate(methods):
            values = [next((float(r["p50"]) * scale for r in rows if r["x_value"] == c
                            and r["method"] == prov and r["metric"] == metric
                            and r["mode"] == mode), 0.0)
                      for c in configs]
            ax.bar([j + i * width for j in range(len(configs))], values, width, label=prov)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))], configs)
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    clocks = {json.loads(r["config_json"]).get("clock", "") for r in rows if r["metric"] == "time"}
    fig.suptitle("transformers Qwen3-MoE experts block, CPU fp32; times: "
                 + ", ".join(CLOCKS.get(c, c) for c in sorted(clocks)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> list[dict[str, str]]:
    """Run every config of ``args``: print each table, return the CSV rows."""
    env, rows = collect_environment("cpu"), []
    for name in args.configs:
        shape = CONFIGS[name]
        results = bench_config(shape, list(args.methods), args.reps, args.warmup)
        label = (f"{shape.label()} fp32, {torch.get_num_threads()} thread(s); x + H floor "
                 f"{format_bytes(shape.floor_bytes(4))}")
        point = Point(suite=BENCHMARK, x_name="config", x_value=shape.name, label=label,
                      config={**shape.to_dict(), "warmup": args.warmup},
                      results=results, reference=hf.REFERENCE)
        print_point(point)
        rows += point_rows(point, env, failed=False)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table, write the CSV and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS),
                        choices=list(METHODS))
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: thread CPU time; more: the wall clock)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_experts_cpu.csv",
                        help="CSV path; the plot goes next to it (.png)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    register_memfine()
    with torch_threads(args.threads):
        rows = run(args)
    write_csv(rows, args.out)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
