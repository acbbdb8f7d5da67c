"""LoRA on a transformers MoE model: PEFT on eager, PEFT on grouped_mm, memfine split LoRA.

One forward + backward of a 1-layer Qwen3-MoE (fp32, CPU) whose LoRA adapters (PEFT
``target_parameters`` on ``experts.gate_up_proj`` / ``experts.down_proj``, r = 8, α = 16) run on:

- ``peft_eager``: PEFT's ParamWrapper (W + s·B·A rebuilt per forward), transformers' eager experts;
- ``peft_grouped_mm``: the same on transformers' ``grouped_mm`` experts;
- ``memfine_split``: memfine's experts under PEFT's own ``get_peft_model`` (no memfine call: the
  experts function finds PEFT's adapters and runs split LoRA);
- ``memfine_attention_lora``: memfine's experts, LoRA on attention only (q, k, v, o projections);
- ``memfine_frozen``: memfine's experts, no adapter, every weight frozen: the frozen-base step
  that the time target compares with.

Every method runs backward down to the embeddings' output (it requires grad), as each layer
above the first does in a deep model whose layers all carry adapters: the activation gradients
of attention and experts are computed in every method, so ``memfine_frozen`` is exactly the
LoRA step minus the adapters' own work.

Per method: peak bytes of the step (``torch.profiler`` with ``profile_memory=True``, above the
state before it), saved-for-backward bytes (saved-tensor hooks, parameters left out), the step's
thread CPU time (``time.thread_time``, methods interleaved per round, p20/p50/p80 over rounds,
and the median of the per-round ratios to the frozen base; ``config_json`` names the clock,
``"clock": "thread_cpu"``, the rounds and the 1-minute load average at the start of the shape),
and the loss and the adapter gradients' largest difference from ``peft_eager`` (same adapters).

Everything runs with one torch thread (``--threads 1``, recorded as ``threads`` in the CSV):
thread CPU time counts the calling thread only, so with intra-op worker threads it would leave
out their work (a different share per method) and the ratios would mean nothing.

Usage: ``python benchmarks/bench_lora.py [--rounds 7] [--threads 1]
[--out benchmarks/results/lora_cpu.csv]``
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import torch

from memfine.bench.harness import THREAD_CPU, percentiles
from memfine.bench.results import csv_row, write_csv
from memfine.environment import collect_environment
from memfine.integrations.transformers import register
from memfine.measure.profiled import profiled_peak_bytes
from memfine.measure.saved import track_saved_tensors

SHAPES = {  # name: (d, n, E, k, tokens)
    "narrow": (256, 128, 32, 4, 1024),
    "wide": (512, 256, 16, 2, 1024),
}
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
METHODS = ("peft_eager", "peft_grouped_mm", "memfine_split", "memfine_attention_lora",
           "memfine_frozen")
BASELINES = {"peak": "memfine_attention_lora", "time": "memfine_frozen"}


def build(shape: tuple[int, ...], seed: int = 0) -> torch.nn.Module:
    """A 1-layer Qwen3-MoE causal LM of ``shape`` (random weights, fp32, train mode)."""
    import transformers

    d, n, E, k, _ = shape
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=d, intermediate_size=2 * d, moe_intermediate_size=n,
        num_experts=E, num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=d // 4, decoder_sparse_step=1, use_cache=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().train()
    # backward reaches the embeddings' output in every method (see the module docstring)
    model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.requires_grad_())
    return model


def models(shape: tuple[int, ...]) -> dict[str, torch.nn.Module]:
    """The PEFT models (expert adapters shared by the first three) and the frozen base."""
    import peft

    register()
    base = build(shape)
    out = {}
    for name in METHODS:
        model = copy.deepcopy(base)
        impl = {"peft_eager": "eager", "peft_grouped_mm": "grouped_mm"}.get(name, "memfine")
        model.set_experts_implementation(impl)
        if name == "memfine_frozen":
            out[name] = model.requires_grad_(False)
            continue
        targets = ATTENTION if name == "memfine_attention_lora" else []
        params = [] if name == "memfine_attention_lora" else EXPERTS
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                 target_parameters=params)
        out[name] = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in (p for n, p in out["peft_eager"].named_parameters() if "lora_B" in n):
            p.normal_(std=0.02)
    for name in ("peft_grouped_mm", "memfine_split"):
        out[name].load_state_dict(out["peft_eager"].state_dict())
    return out


def step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One forward + backward; returns the loss (gradients left on the parameters)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def measure(shape_name: str, rounds: int) -> list[dict[str, str]]:
    """CSV rows of every method at one shape."""
    shape = SHAPES[shape_name]
    ms = models(shape)
    ids = torch.randint(0, 256, (shape[4] // 256, 256))
    env = collect_environment()
    config = dict(zip(("d", "n", "E", "k", "tokens"), shape, strict=True), rank=8, alpha=16,
                  dtype="float32", threads=torch.get_num_threads(), clock=THREAD_CPU,
                  rounds=rounds, load_average_1min_start=round(os.getloadavg()[0], 2))
    rows, losses, grads = [], {}, {}
    for name, model in ms.items():
        losses[name] = step(model, ids)  # warm-up, and the values compared below
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None and ".experts" in n}
        peak = profiled_peak_bytes(lambda m=model: step(m, ids))
        params = [p for p in model.parameters()]
        with track_saved_tensors(exclude=params) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        del loss
        for metric, value in (("peak_bytes", peak), ("saved_bytes", saved.total_bytes)):
            rows.append(csv_row(benchmark="lora", method=name, mode="full", metric=metric,
                                unit="bytes", x_name="shape", x_value=shape_name, values=value,
                                config=config, env=env))
    times: dict[str, list[float]] = {n: [] for n in ms}
    for r in range(rounds):
        order = list(ms) if r % 2 == 0 else list(reversed(ms))
        for name in order:
            t0 = time.thread_time()
            step(ms[name], ids)
            times[name].append((time.thread_time() - t0) * 1e3)
    for name, values in times.items():
        rows.append(csv_row(benchmark="lora", method=name, mode="full", metric="thread_time",
                            unit="ms", x_name="shape", x_value=shape_name,
                            values=percentiles(values), config=config, env=env))
        for base in dict.fromkeys(BASELINES.values()):
            ratio = [v / b for v, b in zip(values, times[base], strict=True)]
            rows.append(csv_row(benchmark="lora", method=name, mode="full",
                                metric=f"time_ratio_to_{base}", unit="ratio", x_name="shape",
                                x_value=shape_name, values=percentiles(ratio), config=config,
                                env=env))
        if name in ("peft_grouped_mm", "memfine_split"):
            diff = max((g - grads["peft_eager"][n]).abs().max().item()
                       for n, g in grads[name].items())
            rows.append(csv_row(benchmark="lora", method=name, mode="full",
                                metric="adapter_grad_max_abs_diff_vs_peft_eager", unit="1",
                                x_name="shape", x_value=shape_name, values=diff, config=config,
                                env=env))
        rows.append(csv_row(benchmark="lora", method=name, mode="full", metric="loss",
                            unit="nats", x_name="shape", x_value=shape_name,
                            values=float(losses[name]), config=config, env=env))
    return rows


def table(rows: list[dict[str, str]]) -> str:
    """The markdown table of docs/lora.md from the CSV rows (MiB = 2^20 bytes)."""
    def get(shape: str, method: str, metric: str) -> float:
        return next(float(r["p50"]) for r in rows if (r["x_value"], r["method"], r["metric"])
                    == (shape, method, metric))

    peak_base, time_base = BASELINES["peak"], BASELINES["time"]
    lines = ["| shape | method | peak MiB | peak / attention-only | saved MiB | time p50 ms | "
             "time / frozen base (median ratio) |", "|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["x_value"] for r in rows):
        d, n, E, k, _ = SHAPES[shape]
        for method in METHODS:
            peak = get(shape, method, "peak_bytes")
            lines.append(
                f"| d {d}, n {n}, E {E}, k {k} | {method} | {peak / 2**20:.1f} | "
                f"{peak / get(shape, peak_base, 'peak_bytes'):.2f} | "
                f"{get(shape, method, 'saved_bytes') / 2**20:.1f} | "
                f"{get(shape, method, 'thread_time'):.0f} | "
                f"{get(shape, method, f'time_ratio_to_{time_base}'):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every shape and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per method")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (thread CPU time counts one thread: keep 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_cpu.csv"))
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)  # before any model: every figure at these threads
    rows = []
    for shape in args.shapes.split(","):
        shape_rows = measure(shape, args.rounds)
        for row in shape_rows:
            if row["metric"] != "time_ratio_to_memfine_attention_lora":  # printed: to frozen
                print(shape, row["method"], row["metric"], row["p50"], row["unit"])
        rows += shape_rows
    write_csv(rows, args.out)
    print(table(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
