"""Cost of the routing pre-pass of gradient accumulation with the balancing loss.

With ``--grad-accum N`` and ``--aux-loss-coef`` > 0, each optimizer step first runs a no-grad
forward of its N micro-batches to count the step's expert selections
(:func:`memfine.train.accumulation.step_selection_counts`), then the N forward + backward passes
that use those counts. This script times both parts on the ``small`` training preset (the model
``make train`` trains: 4 layers, d 128, E 8, k 2, batch 32 × 128 bytes per micro-batch), fp32,
one thread, with the thread's CPU time (user + system; robust to other processes on a shared
machine), and writes the pre-pass's share of the step.

    python benchmarks/bench_grad_accum.py --grad-accum 4 --repeats 5 \\
        --out benchmarks/results/grad_accum_cpu.csv

Methods (CSV ``method``; metric ``thread_cpu_time`` in ms, p20/p50/p80 of ``repeats`` steps):
``micro_batches`` the N forward + backward passes (what a step costs without the pre-pass),
``prepass`` the N no-grad forwards, ``step`` both; metric ``prepass_share`` = prepass ÷ step
(p50s).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from memfine.bench.harness import THREAD_CPU, percentiles
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.nn import MoETransformerLM
from memfine.train.accumulation import step_selection_counts
from memfine.train.presets import preset


def main() -> None:
    """Time the pre-pass and the micro-batches of ``--repeats`` steps; write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/grad_accum_cpu.csv")
    args = parser.parse_args()
    if args.grad_accum < 2 or args.repeats < 1:
        parser.error(f"--grad-accum must be >= 2 and --repeats >= 1, got {args.grad_accum} "
                     f"and {args.repeats}")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    config = preset("small")
    model = MoETransformerLM(config.model)
    B, Q, V = config.batch_size, config.seq_len, config.model.vocab_size
    batches = [torch.randint(0, V, (B, Q + 1)) for _ in range(args.grad_accum)]
    env, load = collect_environment("cpu"), os.getloadavg()[0]
    times: dict[str, list[float]] = {"prepass": [], "micro_batches": [], "step": []}
    moe = config.model.moe
    for repeat in range(args.repeats + 1):  # the first round warms up
        t0 = time.thread_time()
        counts = step_selection_counts(model, [x[:, :-1] for x in batches], contextlib.nullcontext,
                                       torch.device("cpu"))
        t1 = time.thread_time()
        for x_BQ in batches:  # as memfine.train.accumulation.micro_batch
            out = model(x_BQ[:, :-1], x_BQ[:, 1:], step_selection_counts=counts)
            loss = (out.loss + moe.aux_loss_coef * out.load_balancing_loss
                    + moe.z_loss_coef * out.z_loss)
            (loss / args.grad_accum).backward()
        t2 = time.thread_time()
        model.zero_grad(set_to_none=True)
        if repeat:
            times["prepass"].append((t1 - t0) * 1e3)
            times["micro_batches"].append((t2 - t1) * 1e3)
            times["step"].append((t2 - t0) * 1e3)
    config_json = {"preset": "small", "grad_accum": args.grad_accum, "batch": B, "seq_len": Q,
                   "dtype": "float32", "threads": 1, "clock": THREAD_CPU,
                   "load_average_1min_start": round(load, 2), "aux_loss_coef": moe.aux_loss_coef}
    rows = []
    for name, values in times.items():
        p = percentiles(values)
        print(f"{name:14s} {p[1]:9.1f} ms (p50 of {args.repeats})")
        rows.append(csv_row(benchmark="grad_accum", method=name, mode="full",
                            metric="thread_cpu_time", unit="ms", x_name="grad_accum",
                            x_value=args.grad_accum, values=p, config=config_json, env=env))
    share = percentiles(times["prepass"])[1] / percentiles(times["step"])[1]
    print(f"pre-pass share of the step: {share:.3f}")
    rows.append(csv_row(benchmark="grad_accum", method="prepass", mode="full",
                        metric="prepass_share", unit="ratio", x_name="grad_accum",
                        x_value=args.grad_accum, values=share, config=config_json, env=env))
    write_csv(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
