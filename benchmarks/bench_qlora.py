"""QLoRA on memfine's experts: a 4-bit (NF4) frozen base against the bf16 base, split LoRA on both.

One forward + backward of a :class:`memfine.nn.MoELayer` with split LoRA on the routed experts
(r 8, α 16, bf16 compute, CPU) whose frozen base is held either in bf16 (``bf16_split_lora``) or
in NF4 through bitsandbytes (``nf4_split_lora``, ``LoRAConfig(base_quant="nf4")``, block 64),
at the same row blocks (``--block-bytes``). Per method:

- ``resident_expert_bytes``: the routed experts' base as held (bf16 parameters, or the NF4
  codes + absmax + levels buffers);
- ``step_peak_bytes``: peak live bytes of the step above the state before it
  (``torch.profiler`` with ``profile_memory=True``): activations, the dequantised experts of a
  row block, adapter gradients;
- ``total_peak_bytes``: the two summed (the step's peak with the base resident; the adapters
  and router are the same in both and left out).

Targets (``nf4_split_lora`` rows): ``resident_ratio_to_bf16`` ≤ 0.3, and
``total_peak_ratio_to_target_reference`` ≤ 1.15, the reference being the bf16 total peak minus
the weight savings (bf16 resident − NF4 resident). ``adapter_grad_rel_err``: the largest
relative error (Frobenius) over the output, dx and every adapter gradient of the NF4 layer
against dequantise-then-LoRA (the base dequantised once, W + s·B·A formed, the per-token
reference), fp32 compute, at ``--check-tokens`` tokens; target ≤ 1e-5.

Usage: ``python benchmarks/bench_qlora.py [--tokens 4096] [--block-bytes 1048576]
[--out benchmarks/results/qlora_cpu.csv]``
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from memfine.bench.results import csv_row, write_csv
from memfine.config import MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.environment import collect_environment
from memfine.measure.profiled import profiled_peak_bytes
from memfine.nn import MoELayer
from memfine.reference import reference_experts

SHAPE = {"d": 256, "n": 128, "E": 32, "k": 4}
RANK, ALPHA = 8, 16.0


def layer(moe: MoEConfig, quant: bool, dtype: torch.dtype) -> MoELayer:
    """The LoRA layer (seeded), its base in bf16 or NF4; nonzero B so every term is live."""
    torch.manual_seed(0)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, base_quant="nf4" if quant else None)
    out = MoELayer(moe, lora=lora).to(dtype)
    with torch.no_grad():
        for name, p in out.experts.named_parameters():
            if name.startswith("lora_b_"):
                p.normal_(0.0, 0.02)
    return out


def resident_expert_bytes(module: MoELayer) -> int:
    """Bytes of the routed experts' frozen base as held."""
    base = [p for n, p in module.experts.named_parameters() if n in ("w_up", "w_down")]
    return sum(t.nbytes for t in (*base, *module.experts.buffers()))


def step_peak(module: MoELayer, x: torch.Tensor) -> int:
    """Peak bytes of one forward + backward above the state before it."""
    def step() -> None:
        out, aux = module(x)
        (out.float().square().mean() + aux.load_balancing_loss).backward()
    step()  # warm-up (lazy imports, allocator)
    module.zero_grad(set_to_none=True)
    x.grad = None
    peak = profiled_peak_bytes(step)
    module.zero_grad(set_to_none=True)
    return peak


def grad_check(tokens: int) -> float:
    """Largest relative error of the NF4 layer's experts against dequantise-then-LoRA (fp32)."""
    moe = MoEConfig(hidden_size=SHAPE["d"], intermediate_size=SHAPE["n"],
                    num_experts=SHAPE["E"], top_k=SHAPE["k"], renormalize=True,
                    backward_block_bytes=1 << 18)
    experts = layer(moe, True, torch.float32).experts
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, SHAPE["d"], generator=gen, requires_grad=True)
    idx = torch.stack([torch.randperm(SHAPE["E"], generator=gen)[:SHAPE["k"]]
                       for _ in range(tokens)])
    w = torch.rand(tokens, SHAPE["k"], generator=gen)
    out = experts(x, idx, w)
    quant = experts.quantized_base()
    assert quant is not None
    s = ALPHA / RANK
    ad = {n: p for n, p in experts.named_parameters() if n.startswith("lora_")}
    up = quant.up.dequantize() + s * torch.einsum("erd,egr->edg", ad["lora_a_up"],
                                                  ad["lora_b_up"])
    down = quant.down.dequantize() + s * torch.einsum("ern,edr->end", ad["lora_a_down"],
                                                      ad["lora_b_down"])
    ref = reference_experts(x, idx, w, up, down)
    grad = torch.randn_like(out)
    leaves = [x, *ad.values()]
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(ref, leaves, grad)
    errs = [float((a - b).detach().norm() / b.detach().norm()) for a, b in
            ((out, ref), *zip(got, want, strict=True))]
    return max(errs)


def main(argv: list[str] | None = None) -> int:
    """Measure both methods and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-bytes", type=int, default=1 << 20,
                        help="MoEConfig.backward_block_bytes of both methods")
    parser.add_argument("--check-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/qlora_cpu.csv"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*kernels.*")
    torch.set_num_threads(1)
    moe = MoEConfig(hidden_size=SHAPE["d"], intermediate_size=SHAPE["n"],
                    num_experts=SHAPE["E"], top_k=SHAPE["k"], renormalize=True,
                    backward_block_bytes=args.block_bytes)
    x = torch.randn(args.tokens, SHAPE["d"], dtype=torch.bfloat16, requires_grad=True)
    figures = {}
    for method, quant in (("bf16_split_lora", False), ("nf4_split_lora", True)):
        module = layer(moe, quant, torch.bfloat16)
        resident = resident_expert_bytes(module)
        peak = step_peak(module, x)
        figures[method] = {"resident_expert_bytes": resident, "step_peak_bytes": peak,
                           "total_peak_bytes": resident + peak}
        del module
    bf16, nf4 = figures["bf16_split_lora"], figures["nf4_split_lora"]
    savings = bf16["resident_expert_bytes"] - nf4["resident_expert_bytes"]
    reference = bf16["total_peak_bytes"] - savings
    nf4_ratios = {"resident_ratio_to_bf16": nf4["resident_expert_bytes"]
                  / bf16["resident_expert_bytes"],
                  "total_peak_ratio_to_target_reference": nf4["total_peak_bytes"] / reference,
                  "adapter_grad_rel_err": grad_check(args.check_tokens)}
    env = collect_environment()
    config = {**SHAPE, "tokens": args.tokens, "rank": RANK, "alpha": ALPHA,
              "dtype": "bfloat16", "block_bytes": args.block_bytes, "quant_block_size": 64,
              "check_tokens": args.check_tokens, "check_dtype": "float32",
              "peak": "torch.profiler profile_memory, above the state before the step",
              "threads": 1}
    rows = []
    for method, metrics in figures.items():
        for metric, value in metrics.items():
            rows.append(csv_row(benchmark="qlora", method=method, mode="full", metric=metric,
                                unit="bytes", x_name="shape", x_value="narrow", values=value,
                                config=config, env=env))
    for metric, value in nf4_ratios.items():
        rows.append(csv_row(benchmark="qlora", method="nf4_split_lora", mode="full",
                            metric=metric, unit="ratio", x_name="shape", x_value="narrow",
                            values=value, config=config, env=env))
    write_csv(rows, args.out)
    for row in rows:
        print(row["method"], row["metric"], row["p50"], row["unit"])
    print(f"reference (bf16 total - savings) {reference} bytes; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
