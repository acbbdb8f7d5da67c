"""LoRA on a transformers MoE model: PEFT on eager, PEFT on grouped_mm, memfine split LoRA.

One forward + backward of a 1-layer Qwen3-MoE (fp32, CPU) whose LoRA adapters (PEFT
``target_parameters`` on ``experts.gate_up_proj`` / ``experts.down_proj``, r = 8, α = 16) run on:

- ``peft_eager``: PEFT's ParamWrapper (W + s·B·A rebuilt per forward), transformers' eager experts;
- ``peft_grouped_mm``: the same on transformers' ``grouped_mm`` experts;
- ``memfine_split``: memfine's experts with :func:`memfine.integrations.hf.peft.split_lora`;
- ``memfine_attention_lora``: memfine's experts, LoRA on attention only (q, k, v, o projections):
  the frozen-base memfine step that the targets compare with.

Per method: peak bytes of the step (``torch.profiler`` with ``profile_memory=True``, above the
state before it), saved-for-backward bytes (saved-tensor hooks, parameters left out), the step's
thread CPU time (``time.thread_time``, methods interleaved per round, p20/p50/p80 over rounds),
and the loss and the adapter gradients' largest difference from ``peft_eager`` (same adapters).

Usage: ``python benchmarks/bench_lora.py [--rounds 7] [--out benchmarks/results/lora_cpu.csv]``
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from memfine.bench.harness import percentiles
from memfine.bench.results import csv_row, write_csv
from memfine.environment import collect_environment
from memfine.integrations.hf.peft import split_lora
from memfine.integrations.transformers import register
from memfine.measure.profiled import profiled_peak_bytes
from memfine.measure.saved import track_saved_tensors

SHAPES = {  # name: (d, n, E, k, tokens)
    "narrow": (256, 128, 32, 4, 1024),
    "wide": (512, 256, 16, 2, 1024),
}
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
METHODS = ("peft_eager", "peft_grouped_mm", "memfine_split", "memfine_attention_lora")


def build(shape: tuple[int, ...], seed: int = 0) -> torch.nn.Module:
    """A 1-layer Qwen3-MoE causal LM of ``shape`` (random weights, fp32, train mode)."""
    import transformers

    d, n, E, k, _ = shape
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=d, intermediate_size=2 * d, moe_intermediate_size=n,
        num_experts=E, num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=d // 4, decoder_sparse_step=1, use_cache=False)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).float().train()


def models(shape: tuple[int, ...]) -> dict[str, torch.nn.Module]:
    """The four PEFT models, the expert adapters shared (same values) by the first three."""
    import peft

    register()
    base = build(shape)
    out = {}
    for name in METHODS:
        model = copy.deepcopy(base)
        impl = {"peft_eager": "eager", "peft_grouped_mm": "grouped_mm"}.get(name, "memfine")
        model.set_experts_implementation(impl)
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
    split_lora(out["memfine_split"])
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
                  dtype="float32", threads=torch.get_num_threads())
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
    base = times["memfine_attention_lora"]
    for name, values in times.items():
        ratio = [v / b for v, b in zip(values, base, strict=True)]
        rows.append(csv_row(benchmark="lora", method=name, mode="full", metric="thread_time",
                            unit="ms", x_name="shape", x_value=shape_name,
                            values=percentiles(values), config=config, env=env))
        rows.append(csv_row(benchmark="lora", method=name, mode="full",
                            metric="time_ratio_to_memfine_attention_lora", unit="ratio",
                            x_name="shape", x_value=shape_name, values=percentiles(ratio),
                            config=config, env=env))
        if name != "memfine_attention_lora":
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


def main(argv: list[str] | None = None) -> int:
    """Run every shape and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per method")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_cpu.csv"))
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        shape_rows = measure(shape, args.rounds)
        for row in shape_rows:
            if row["metric"] != "time_ratio_to_memfine_attention_lora":
                print(shape, row["method"], row["metric"], row["p50"], row["unit"])
        rows += shape_rows
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
