"""Peak live bytes of one MoE layer forward + backward, per method, from ``torch.profiler``.

One MoE layer (``--shape coarse``: d = 512, n = 1024, E = 16, k = 4; ``--shape fine``: the
fine-grained d = 512, n = 128, E = 64, k = 8; SwiGLU, fp32, router + experts) at several token
counts T; each method runs once per T under ``torch.profiler(profile_memory=True)``
(:class:`memfine.measure.ProfiledPeakMemory`, the CPU ground truth) with the saved-tensor hooks
during forward. Methods: memfine fused, memfine fused with c ∈ {2, 4, 8} token chunks
(per-chunk recompute), and the baselines: the plain autograd path over gathered / scattered
copies with the per-expert loop GEMM and with ``torch._grouped_mm`` (torchtitan style), and the
per-expert loop with index masks (transformers ``eager`` style). memfine's methods also get the
memory model's prediction. No timing: memory only.

    python benchmarks/bench_peak.py --tokens 256 1024 2048 4096 8192 16384 \
        --out benchmarks/results/peak_cpu.csv
    python benchmarks/bench_peak.py --shape fine --tokens 1024 4096 16384 \
        --out benchmarks/results/peak_cpu_fine.csv

Writes one CSV row per method × T × metric (``peak_bytes``, ``saved_bytes``,
``predicted_peak_bytes``, ``x_plus_h_bytes``: the saved floor x + H = (T·d + T·k·2n)·4; unit
bytes) with versions, git SHA and the load average at the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

import torch

from memfine.baselines.layers import (
    ExpertLoopMoELayer,
    base_layer,
    layer_inputs,
    layer_method,
    sharing,
)
from memfine.bench.harness import Method
from memfine.bench.options import LayerShape
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.config import ChunkConfig, MoEConfig
from memfine.measure import measure_memory
from memfine.units import format_bytes

CHUNKS = (2, 4, 8)
SHAPES = {"coarse": (512, 1024, 16, 4), "fine": (512, 128, 64, 8)}
"""--shape → (d, n, E, k)."""


def methods(T: int, seed: int, shape_name: str = "coarse") -> list[Method]:
    """Every method of one token count, sharing weights, input and incoming gradient."""
    d, n, E, k = SHAPES[shape_name]
    shape = LayerShape(name=f"T{T}", tokens=T, hidden_size=d, intermediate_size=n,
                       num_experts=E, top_k=k)
    moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=k)
    base = base_layer(moe, dtype=torch.float32, device=torch.device("cpu"), seed=seed)
    x_TD, grad_TD = layer_inputs(shape, dtype=torch.float32, device=torch.device("cpu"),
                                 seed=seed)
    loop = dataclasses.replace(moe, experts_impl="plain", gemm_backend="loop")
    gmm = dataclasses.replace(moe, experts_impl="plain", gemm_backend="grouped_mm")
    builders: list[Callable[[], Method]] = [
        lambda: layer_method("fused", sharing(base, moe), x_TD, grad_TD),
        lambda: layer_method("plain", sharing(base, loop), x_TD, grad_TD),
        lambda: layer_method("grouped_mm", sharing(base, gmm), x_TD, grad_TD),
        lambda: layer_method("expert_loop", sharing(base, moe, cls=ExpertLoopMoELayer), x_TD,
                             grad_TD, modelled=False),
    ]
    for c in CHUNKS:
        chunk = ChunkConfig(num_chunks=c, recompute="experts")
        builders.append(lambda c=c, chunk=chunk: layer_method(
            f"fused_c{c}", sharing(base, moe, chunk=chunk), x_TD, grad_TD))
    return [build() for build in builders]


def measure(method: Method) -> dict[str, int | None]:
    """Saved bytes and profiler peak bytes of one forward + backward; the model's peak."""
    method.zero_grad()
    with measure_memory(exclude=method.exclude(), peak="profiler") as m:
        res = method.forward()
        m.end_forward()
        method.backward(res)
        del res
    report = m.report()
    predicted = method.predict() if method.predict is not None else {}
    return {"peak_bytes": report.peak_bytes, "saved_bytes": report.saved_bytes,
            "predicted_peak_bytes": predicted.get("peak_bytes")}


def main() -> None:
    """Run every method at every T; print a table and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--out", default="benchmarks/results/peak_cpu.csv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="coarse")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = collect_environment("cpu")
    load = os.getloadavg()[0]
    rows = []
    d, n, E, k = SHAPES[args.shape]
    for T in args.tokens:
        for method in methods(T, args.seed, args.shape):
            values = measure(method)
            values["x_plus_h_bytes"] = (T * d + T * k * 2 * n) * 4
            print(f"T={T:6d} {method.name:12s} peak {format_bytes(values['peak_bytes'] or 0):>12}"
                  f"  saved {format_bytes(values['saved_bytes'] or 0):>12}", flush=True)
            config = {"d": d, "n": n, "E": E, "k": k, "dtype": "float32",
                      "peak": "torch.profiler", "load_average_1min": round(load, 2)}
            rows += [csv_row(benchmark="peak", method=method.name, mode="full", metric=metric,
                             unit="bytes", x_name="tokens", x_value=T, values=value,
                             config=config, env=env) for metric, value in values.items()]
    write_csv(rows, args.out)
    print(f"wrote {args.out} (load average at start {load:.1f})")


if __name__ == "__main__":
    main()
