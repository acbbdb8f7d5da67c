"""Outputs of one MoE layer, method by method, against fused and against an fp32 plain path.

    gpu_check_equal.py CSV --device cuda --tokens 16384 --hidden-size 2048 \
        --intermediate-size 768 --num-experts 128 --top-k 8

Methods share one set of weights and one input (bf16): ``fused`` (c = 1), ``chunked_c4``
(4 chunks, per-chunk recompute), ``mact`` (c chosen from a budget of half the unchunked peak
the memory model predicts), ``plain_grouped_mm`` (torchtitan-style: gathered copies through
torch._grouped_mm) and ``torchtitan`` (torchtitan's own RoutedExperts on the same weights and
routing; one ``skipped`` row saying why when torchtitan cannot be imported). Each row: max
|out - fused| and max |out - fp32 plain| (the same layer in fp32), plus the input gradient's
max |dx - fused dx|. Appends rows to scripts/gpu_check.sh's CSV.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path

import torch

from memfine.baselines.titan_style import torchtitan_layer, torchtitan_missing
from memfine.config import ChunkConfig, MoEConfig
from memfine.memory.layer import moe_layer_memory
from memfine.nn import MoELayer


def _run(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.float().square().mean().backward()
    assert x.grad is not None
    return out.detach().float(), x.grad.float()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", type=Path)
    parser.add_argument("--device", default="cuda")
    for flag, default in (("--tokens", 16384), ("--hidden-size", 2048),
                          ("--intermediate-size", 768), ("--num-experts", 128), ("--top-k", 8)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    moe = MoEConfig(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                    num_experts=args.num_experts, top_k=args.top_k)
    T, dtype = args.tokens, torch.bfloat16
    budget = moe_layer_memory(moe, T, dtype.itemsize).peak_bytes // 2
    chunks = {"fused": ChunkConfig(), "chunked_c4": ChunkConfig(num_chunks=4, recompute="experts"),
              "mact": ChunkConfig(memory_budget_bytes=budget, recompute="experts",
                                  allow_over_budget=True)}
    torch.manual_seed(0)
    x = torch.randn(T, args.hidden_size)
    with torch.device(args.device):  # initialised where they run: seconds at Qwen3 size
        base = MoELayer(moe)
        layers = {name: MoELayer(moe, chunk=chunk) for name, chunk in chunks.items()}
        layers["plain_grouped_mm"] = MoELayer(dataclasses.replace(moe, experts_impl="plain",
                                                                  gemm_backend="grouped_mm"))
    for layer in layers.values():
        layer.load_state_dict(base.state_dict())
        layer.to(args.device, dtype)
    missing = torchtitan_missing()
    if missing is None:  # torchtitan's experts on the fused layer's weights, memfine's router
        layers["torchtitan"] = torchtitan_layer(layers["fused"], moe)
    results = {name: _run(layer, x.to(args.device, dtype)) for name, layer in layers.items()}
    ref_out, _ = _run(base.to(args.device), x.to(args.device))  # fp32 plain reference: fused fp32
    rows = [["equality", "fp32", "ok", "max_abs_out", f"{float(ref_out.abs().max()):.6g}", "",
             f"T={T} fp32 device={args.device} (scale of the differences below)"]]
    if missing is not None:
        rows.append(["equality", "torchtitan", "skipped", "", "", "", missing])
    for name, (out, dx) in results.items():
        fused_out, fused_dx = results["fused"]
        for metric, value in (("max_abs_diff_vs_fused", (out - fused_out).abs().max()),
                              ("max_abs_diff_vs_fp32", (out - ref_out).abs().max()),
                              ("dx_max_abs_diff_vs_fused", (dx - fused_dx).abs().max())):
            rows.append(["equality", name, "ok", metric, f"{float(value):.6g}", "",
                         f"T={T} bf16 device={args.device}"])
    with args.csv.open("a", newline="") as f:
        csv.writer(f).writerows(rows)
    for row in rows:
        print(",".join(map(str, row)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
