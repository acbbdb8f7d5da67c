"""torch.compile and autocast on one MoE layer (CPU): time ratios and saved bytes.

Rows: eager fp32, compiled fp32 (inductor, capture_scalar_outputs), eager under
torch.autocast(bf16) with fp32 master weights. Each: forward + backward of the layer, median of
``--repeats`` after two warm-up calls (the first compiled call compiles), and, for the eager
rows, the bytes saved for backward by one forward (saved-tensor hooks, parameters left out; the
hooks do not see inside a compiled graph, so the compiled row has no saved bytes). Writes
benchmarks/results/compile_cpu.csv (one row per method and metric, with units and versions).

    python benchmarks/bench_compile.py [--tokens 512] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import subprocess
import time
from pathlib import Path

import torch

import memfine
from memfine.config import MoEConfig
from memfine.measure import SavedTensorsTracker
from memfine.nn import MoELayer

OUT = Path(__file__).parent / "results" / "compile_cpu.csv"


def _step(fn, layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> None:
    for p in layer.parameters():
        p.grad = None
    out, aux = fn(x)
    torch.autograd.backward([out, aux.load_balancing_loss, aux.z_loss],
                            [grad.to(out.dtype), torch.ones(()), torch.ones(())])


def _measure(fn, layer: MoELayer, x: torch.Tensor, grad: torch.Tensor,
             repeats: int, autocast: bool) -> dict[str, float]:
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else \
        (lambda: torch.autocast("cpu", enabled=False))
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for _ in range(2):
            with ctx():
                _step(fn, layer, x, grad)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            with ctx():
                _step(fn, layer, x, grad)
            times.append(time.perf_counter() - t0)
    row = {"fwd_bwd_s": statistics.median(times)}
    if fn is layer:
        with ctx(), SavedTensorsTracker(exclude=layer.parameters()) as saved:
            layer(x)
        row["saved_bytes"] = saved.total_bytes
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    moe = MoEConfig(hidden_size=128, intermediate_size=256, num_experts=8, top_k=2)
    layer = MoELayer(moe)
    x = torch.randn(args.tokens, moe.hidden_size, requires_grad=True)
    grad = torch.randn(args.tokens, moe.hidden_size)
    compiled = torch.compile(layer, fullgraph=True)
    rows = {
        "eager_fp32": _measure(layer, layer, x, grad, args.repeats, False),
        "compiled_fp32": _measure(compiled, layer, x, grad, args.repeats, False),
        "eager_autocast_bf16": _measure(layer, layer, x, grad, args.repeats, True),
    }
    base = rows["eager_fp32"]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=False).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["benchmark", "provider", "metric", "unit", "value", "ratio_to_eager_fp32",
                    "tokens", "config", "torch", "memfine", "threads", "git_sha", "utc"])
        for name, row in rows.items():
            for metric, unit in (("fwd_bwd_s", "s"), ("saved_bytes", "bytes")):
                if metric not in row:
                    continue
                w.writerow(["compile_layer", name, metric, unit, f"{row[metric]:.6g}",
                            f"{row[metric] / base[metric]:.4f}", args.tokens,
                            "d=128,n=256,E=8,k=2,swiglu,fused", torch.__version__,
                            getattr(memfine, "__version__", ""),
                            args.threads, sha, stamp])
            saved = row.get("saved_bytes")
            saved_text = (f"saved {saved:,} bytes ({saved / base['saved_bytes']:.3f}x)"
                          if saved is not None else "saved bytes not measured")
            print(f"{name:22s} {row['fwd_bwd_s'] * 1e3:9.2f} ms "
                  f"({row['fwd_bwd_s'] / base['fwd_bwd_s']:.3f}x)  {saved_text}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
