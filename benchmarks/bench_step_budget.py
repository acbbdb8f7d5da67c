"""A whole-step memory budget on the mid model: the step plan against every fixed policy.

Model: 4 blocks, d 256, n 512, E 16, k 4, 4 heads, B 4 × Q 128 tokens (T = 512), fp32, CPU.
Fixed policies: no recompute (c = 1), chunked expert recompute and full block recompute with
c ∈ {1, 2, 4, 8}, the same in every layer. Step plans (:class:`memfine.memory.step.StepPlanner`)
at 5 budgets evenly from full recompute's measured step peak (c = 1) to no recompute's.

Per method: the step's peak measured by ``torch.profiler`` (:class:`memfine.measure.profiled.
ProfiledPeakMemory`; the step's protocol: parameters without ``.grad``, loss = CE + aux losses)
next to the step timeline's prediction, and the step's time: thread CPU time
(``time.thread_time``; the CSV's ``clock`` column), every method once per round in one process,
interleaved (the order rotates every round), the median over rounds of the ratio to full
recompute (c = 1) in the same round; one intra-op thread, so the thread's CPU time is the whole
step's. The machine's 1-minute load average at the end is the ``load_average_1min`` column.

Output: ``benchmarks/results/step_budget_cpu.csv`` (one row per method; units in the column
names; the environment in the last columns).

Usage: ``python benchmarks/bench_step_budget.py [--rounds 7] [--out PATH]``
Reference: MemFine §4 (Table 4: full recompute vs fixed c vs MACT); docs/design.md §4-§5.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch

from memfine.bench.harness import THREAD_CPU, interleaved_order
from memfine.config import ModelConfig, MoEConfig
from memfine.environment import collect_environment
from memfine.measure.profiled import ProfiledPeakMemory
from memfine.memory.step import StepPlan, StepPlanner
from memfine.memory.step_timeline import LayerChoice
from memfine.nn import MoETransformerLM

MOE = MoEConfig(hidden_size=256, intermediate_size=512, num_experts=16, top_k=4)
CONFIG = ModelConfig(num_layers=4, num_heads=4, max_seq_len=128, moe=MOE)
B, Q, BUDGETS = 4, 128, 5
MIB = 2**20


def _name(plan: StepPlan) -> str:
    return " ".join(f"{c.recompute[0]}{c.num_chunks}" for c in plan.choices)


def _step(model: MoETransformerLM, ids: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    out = model(ids, ids)
    moe = CONFIG.moe
    loss = out.loss + moe.aux_loss_coef * out.load_balancing_loss + moe.z_loss_coef * out.z_loss
    loss.backward()


def _peak(model: MoETransformerLM, ids: torch.Tensor) -> int:
    for p in model.parameters():
        p.grad = None
    with ProfiledPeakMemory() as prof:
        _step(model, ids)
    return int(prof.peak_bytes)


def main() -> None:
    """Measure, print and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/step_budget_cpu.csv")
    args = parser.parse_args()
    torch.set_num_threads(1)  # thread CPU time then covers all the step's work
    torch.manual_seed(0)
    model = MoETransformerLM(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (B, Q))
    planner = StepPlanner(CONFIG, B, Q, 4)
    fixed: dict[str, StepPlan] = {}
    for mode in ("none", "experts", "full"):
        for c in ((1,) if mode == "none" else CONFIG.chunk.bins):
            choices = (LayerChoice(mode, c),) * CONFIG.num_layers
            fixed[f"{mode} c={c}"] = StepPlan(choices, planner.peak(choices), 0)
    _step(model, ids)  # warm-up
    peaks: dict[str, int] = {}

    def measure(name: str, plan: StepPlan) -> None:
        model.apply_plan(plan)
        peaks[name] = _peak(model, ids)
        print(f"measured {name}: {peaks[name] / MIB:.2f} MiB", flush=True)

    for name, plan in fixed.items():
        measure(name, plan)
    # 5 budgets from full recompute's measured step peak (c = 1) to no recompute's
    low, high = peaks["full c=1"], peaks["none c=1"]
    plans: dict[str, tuple[int, StepPlan]] = {}
    for i in range(BUDGETS):
        budget = low + (high - low) * i // (BUDGETS - 1)
        plan = planner.plan(budget)
        assert plan is not None
        name = f"plan @ {budget / MIB:.2f} MiB"
        plans[name] = (budget, plan)
        measure(name, plan)
    methods = {**fixed, **{name: plan for name, (_, plan) in plans.items()}}
    ratios: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(args.rounds):
        times = {}
        for name in interleaved_order(list(methods), r):
            model.apply_plan(methods[name])
            start = time.thread_time()
            _step(model, ids)
            times[name] = time.thread_time() - start
        for name in methods:
            ratios[name].append(times[name] / times["full c=1"])
    ratio = {name: statistics.median(r) for name, r in ratios.items()}
    env = collect_environment()
    rows = []
    for name, plan in methods.items():
        budget = plans[name][0] if name in plans else None
        fitting = [f for f in fixed if budget is not None and peaks[f] <= budget]
        best = min(fitting, key=ratio.__getitem__) if fitting else ""
        rows.append({
            "method": name, "layers": _name(plan),
            "budget_bytes": "" if budget is None else budget,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": peaks[name],
            "predicted_over_measured": f"{plan.predicted_peak_bytes / peaks[name]:.4f}",
            "fits_budget": "" if budget is None else peaks[name] <= budget,
            "time_over_full_recompute": f"{ratio[name]:.4f}",
            "fastest_fitting_fixed": best,
            "time_over_fastest_fitting_fixed": f"{ratio[name] / ratio[best]:.4f}" if best else "",
            "clock": THREAD_CPU, "rounds": args.rounds,
            "load_average_1min": round(os.getloadavg()[0], 2),
            "tokens": B * Q, "device": env.device, "cpu": env.cpu_model,
            "threads": env.threads, "torch": env.torch_version, "memfine": env.memfine_version,
            "git_sha": env.git_sha, "utc": env.utc_timestamp})
        print(f"{name:22s} {_name(plan):16s} pred {plan.predicted_peak_bytes / MIB:8.2f} MiB "
              f"meas {peaks[name] / MIB:8.2f} MiB  time/full {ratio[name]:.3f}  "
              f"{'' if not best else f'fastest fitting fixed: {best} ({ratio[best]:.3f})'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
