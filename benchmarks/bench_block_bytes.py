"""CPU time of the fused layer per row-block size (``MoEConfig.backward_block_bytes``).

One MoE layer forward + backward (SwiGLU, fp32, one thread, router + experts) on the fused path
with the CPU's default blocks (``backward_block_bytes=None``: 16 MiB, at least
:data:`memfine.config.MIN_BLOCK_ROWS` and at most :data:`memfine.config.CPU_MAX_BLOCK_ROWS`
rows), with the streamed forward and backward in blocks of 4, 8, 16, 32 and 64 MiB and as one
block, at the coarse (d 512, n 1024, E 16, k 4), the fine-grained (d 512, n 128, E 64, k 8) and
the training preset's (``small``: d = n = 128, E 8, k 2) shapes. Methods of one shape run
interleaved in this process (:func:`memfine.bench.harness.run_methods`) and are timed with the
thread's CPU time (``time.thread_time``), which other processes on a shared machine do not
inflate. The CSV gives per block size the thread CPU time (p20/p50/p80 in ms), the rows per
block (``block_rows``) and, per round, its time ÷ the default's time (p20/p50/p80 over the
rounds).

    python benchmarks/bench_block_bytes.py --tokens 4096 --repeats 7 \
        --out benchmarks/results/block_bytes_cpu.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import bench_flops  # this folder's FLOP-rate script: its shapes and layer set-up
import torch

from memfine.baselines.layers import layer_method, sharing
from memfine.bench.harness import Method, percentiles, run_methods
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.config import MoEConfig, config_block_rows

BLOCKS_MIB = (4, 8, 16, 32, 64)
ONE_BLOCK = 2**40
"""A byte target above every S·row bytes measured here: one block."""
SHAPES = {**bench_flops.SHAPES, "small": (128, 128, 8, 2)}
"""--shape → (d, n, E, k): the FLOP-rate script's and the ``small`` training preset's layer."""


def methods(shape_name: str, T: int, seed: int) -> list[Method]:
    """The fused layer at every block size (shared weights, input and incoming gradient)."""
    bench_flops.SHAPES.update(SHAPES)
    bench_flops.use_shape(shape_name)
    moe, base, x_TD, grad_TD = bench_flops.layer_setup(T, seed)
    return [layer_method(name, sharing(base, config), x_TD, grad_TD, modelled=False)
            for name, config in configs(moe).items()]


def configs(moe: MoEConfig) -> dict[str, MoEConfig]:
    """Method name → the layer config of that block size (``default``: None, the CPU's)."""
    sizes = [("default", None), *((f"{mib}MiB", mib * 2**20) for mib in BLOCKS_MIB),
             ("one_block", ONE_BLOCK)]
    return {name: dataclasses.replace(moe, backward_block_bytes=b) for name, b in sizes}


def main() -> None:
    """Time every block size at every shape; print the table and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/block_bytes_cpu.csv")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env, load_start = collect_environment("cpu"), os.getloadavg()[0]
    rows = []
    for shape_name, (d, n, E, k) in SHAPES.items():
        layers = methods(shape_name, args.tokens, args.seed)
        results = run_methods(layers, repeats=args.repeats, warmup=args.warmup, measure=False,
                              clock=time.thread_time)
        default = results[0].times_s["full"]
        moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=k)
        block_rows = {name: min(args.tokens * k, config_block_rows(config, 4, "cpu"))
                      for name, config in configs(moe).items()}
        config = {"shape": shape_name, "d": d, "n": n, "E": E, "k": k, "dtype": "float32",
                  "activation": "swiglu", "repeats": args.repeats, "clock": "thread",
                  "load_average_1min_start": round(load_start, 2)}
        for res in results:
            if res.error:
                raise RuntimeError(f"{res.name} ({shape_name}): {res.error}")
            ratios = percentiles([t / t0 for t, t0 in zip(res.times_s["full"], default,
                                                          strict=True)])
            print(f"{shape_name:6s} {res.name:10s} {block_rows[res.name]:7d} rows "
                  f"{res.time_ms('full')[1]:9.1f} ms {ratios[1]:6.3f}x the default's time",
                  flush=True)
            common = {"benchmark": "block_bytes", "method": res.name, "mode": "full",
                      "x_name": "tokens", "x_value": args.tokens, "config": config, "env": env}
            rows += [csv_row(metric="thread_cpu_time", unit="ms", values=res.time_ms("full"),
                             **common),
                     csv_row(metric="time_vs_default", unit="ratio", values=ratios, **common),
                     csv_row(metric="block_rows", unit="rows", values=block_rows[res.name],
                             **common)]
    write_csv(rows, args.out)
    print(f"wrote {args.out} (load average {load_start:.1f} at start)")


if __name__ == "__main__":
    main()
