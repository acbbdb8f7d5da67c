"""Where the time of one ``experts`` suite shape goes: self CPU time per operator, per method.

The methods of ``memfine bench --suites experts`` (:func:`memfine.suites.experts.build_methods`,
the same weights, input and routing) at one MoEBlaze Table 1 conf, one torch thread, fp32: one
warm-up call per method, then ``--calls`` calls of each under ``torch.profiler`` (CPU activity),
methods interleaved call by call. Per method the CSV gives the ``--top`` operators by self CPU
time summed over the profiled calls and divided by ``--calls`` (ms per call), plus ``gemm
total`` (mm, addmm, bmm, ``_grouped_mm``), ``other total`` and ``total`` (metric
``self_cpu_time_per_call``), and every matrix product by operator and input shapes (metric
``gemm_self_cpu_time_per_call``, x_value ``<operator> <input shapes>``): an expert whose rows
two row blocks share shows as two products with fewer rows each.

The profiler's self times are elapsed (wall) time inside each operator: on a shared machine
they include waiting for a core, so compare operators within one run and read the thread CPU
time of the ``experts`` suite (``bench_experts.csv``) for the methods' totals.

    python benchmarks/profile_experts.py --conf 2 --methods fused grouped_mm \
        --out benchmarks/results/profile_experts_conf2_cpu.csv
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from memfine.bench.harness import interleaved_order
from memfine.bench.options import BenchOptions, table1_shape
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.suites.experts import METHODS, build_methods

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_grouped_mm")


def main() -> None:
    """Profile the methods at one conf; print and write the per-operator rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conf", type=int, default=2, help="MoEBlaze Table 1 row")
    parser.add_argument("--methods", nargs="+", default=["fused", "grouped_mm"], choices=METHODS)
    parser.add_argument("--calls", type=int, default=3, help="profiled calls per method")
    parser.add_argument("--top", type=int, default=15, help="operators listed per method")
    parser.add_argument("--out", default="benchmarks/results/profile_experts_conf2_cpu.csv")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    opts = BenchOptions(suites=("experts",), threads=1)
    shape = table1_shape(args.conf, opts.scale_down)
    methods, _ = build_methods(shape, opts, torch.device("cpu"), tuple(args.methods))
    by_name = {m.name: m for m in methods}
    self_ms: dict[str, dict[str, float]] = {m.name: defaultdict(float) for m in methods}
    gemm_ms: dict[str, dict[str, float]] = {m.name: defaultdict(float) for m in methods}
    for call in range(args.calls + 1):  # call 0: warm-up, not profiled
        for name in interleaved_order(list(by_name), call):
            method = by_name[name]
            method.zero_grad()
            if call == 0:
                method.backward(method.forward())
                continue
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                method.backward(method.forward())
            for ev in prof.key_averages(group_by_input_shape=True):
                ms = ev.self_cpu_time_total / 1e3 / args.calls
                self_ms[name][ev.key] += ms
                if ev.key in GEMM_OPS:
                    gemm_ms[name][f"{ev.key} {ev.input_shapes}"] += ms
    env = collect_environment("cpu")
    config = {**shape.to_dict(), "dtype": "float32", "threads": 1, "calls": args.calls,
              "clock": "profiler self time (elapsed)", "load_average_1min_start":
              round(load_start, 2), "load_average_1min_end": round(os.getloadavg()[0], 2)}
    rows = []
    for name, ops in self_ms.items():
        gemm = sum(ms for op, ms in ops.items() if op in GEMM_OPS)
        total = sum(ops.values())
        ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]
        by_shape = sorted(gemm_ms[name].items(), key=lambda kv: -kv[1])
        for metric, items in (("self_cpu_time_per_call", [*ranked, ("gemm total", gemm),
                                                           ("other total", total - gemm),
                                                           ("total", total)]),
                              ("gemm_self_cpu_time_per_call", by_shape)):
            for op, ms in items:
                print(f"{name:12s} {op:45s} {ms:9.2f} ms")
                rows.append(csv_row(benchmark="profile_experts", method=name, mode="full",
                                    metric=metric, unit="ms", x_name="operator", x_value=op,
                                    values=ms, config=config, env=env))
    write_csv(rows, args.out)
    print(f"wrote {args.out} (load average {load_start:.2f} at start, "
          f"{config['load_average_1min_end']:.2f} at the end)")


if __name__ == "__main__":
    main()
