"""FLOP rate of one MoE layer's forward + backward: memfine fused against raw grouped GEMMs.

One MoE layer (``--shape coarse``: d = 512, n = 1024, E = 16, k = 4; ``--shape fine``: the
fine-grained d = 512, n = 128, E = 64, k = 8; SwiGLU, fp32, router + experts) at several
token counts T, forward + backward, timed with :func:`memfine.bench.harness.run_methods`
(warm-up, then interleaved rounds, p20/p50/p80 of ``repeats`` calls). Methods:

- ``raw_grouped_gemms``: only the three grouped GEMMs of the experts and their gradients
  (``torch._grouped_mm`` on contiguous, already expert-grouped operands with balanced groups:
  H = X·W_up, Y = A·W_down forward; dA, dW_down, dX, dW_up backward). No router, gather,
  activation or combine: the arithmetic alone.
- ``fused``: memfine's layer on the fused path (default config).
- ``grouped_mm``: the torchtitan-style layer: autograd over gathered / scattered copies with
  ``torch._grouped_mm``.
- ``plain``: the same autograd path with the per-expert loop GEMM.

FLOPs per forward + backward: 18·T·k·d·n (6·S·d·n forward for the gated up-projection and the
down-projection, twice that backward; S = T·k). GFLOP/s = that count ÷ the call's seconds ÷ 1e9.

    python benchmarks/bench_flops.py --tokens 2048 4096 8192 16384 --repeats 5 --clock thread \
        --out benchmarks/results/flops_cpu.csv
    python benchmarks/bench_flops.py --shape fine --tokens 4096 --repeats 7 --clock thread \
        --out benchmarks/results/flops_cpu_fine.csv
    python benchmarks/bench_flops.py --profile 4096 --out benchmarks/results/flops_profile_cpu.csv

Writes one CSV row per method × T × metric (``time`` in ms, or ``thread_cpu_time`` with
``--clock thread``, ``gflops`` in GFLOP/s, both
p20/p50/p80; ``flops`` per call; ``rate_vs_raw``: per round, the raw GEMMs' time ÷ the
method's time, p20/p50/p80 over the rounds) with versions, git SHA and the 1-minute load
average at the start and the end of the run (the machine may be shared: compare methods of one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import torch

from memfine.baselines.layers import base_layer, layer_inputs, layer_method, sharing
from memfine.bench.harness import Method, percentiles, run_methods
from memfine.bench.options import LayerShape
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.config import MoEConfig

SHAPES = {"coarse": (512, 1024, 16, 4), "fine": (512, 128, 64, 8)}
"""--shape → (d, n, E, k)."""
D, N, E, K = SHAPES["coarse"]


def use_shape(name: str) -> None:
    """Set the module's (d, n, E, k) to :data:`SHAPES` ``[name]``."""
    global D, N, E, K
    D, N, E, K = SHAPES[name]


def raw_grouped_gemms(T: int, seed: int) -> Method:
    """The experts' six grouped GEMMs (three forward-backward pairs) on ready operands."""
    S = T * K
    gen = torch.Generator().manual_seed(seed)
    offs_E = (torch.arange(1, E + 1) * (S // E)).int()
    offs_E[-1] = S
    x_SD, a_SN = torch.randn(S, D, generator=gen), torch.randn(S, N, generator=gen)
    dy_SD, dh_SG = torch.randn(S, D, generator=gen), torch.randn(S, 2 * N, generator=gen)
    w_up = torch.randn(E, D, 2 * N, generator=gen) * 0.02
    w_down = torch.randn(E, N, D, generator=gen) * 0.02

    def forward() -> Any:
        return (torch._grouped_mm(x_SD, w_up, offs=offs_E),
                torch._grouped_mm(a_SN, w_down, offs=offs_E))

    def backward(_: Any) -> None:
        torch._grouped_mm(dy_SD, w_down.transpose(1, 2), offs=offs_E)
        torch._grouped_mm(a_SN.t(), dy_SD, offs=offs_E)
        torch._grouped_mm(dh_SG, w_up.transpose(1, 2), offs=offs_E)
        torch._grouped_mm(x_SD.t(), dh_SG, offs=offs_E)

    return Method(name="raw_grouped_gemms", forward=forward, backward=backward, tokens=T)


def layer_setup(T: int, seed: int) -> tuple[MoEConfig, Any, torch.Tensor, torch.Tensor]:
    """(config, fp32 base layer, x (T, d), incoming gradient) at the module's (d, n, E, k)."""
    shape = LayerShape(name=f"T{T}", tokens=T, hidden_size=D, intermediate_size=N,
                       num_experts=E, top_k=K)
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    cpu = torch.device("cpu")
    base = base_layer(moe, dtype=torch.float32, device=cpu, seed=seed)
    x_TD, grad_TD = layer_inputs(shape, dtype=torch.float32, device=cpu, seed=seed)
    return moe, base, x_TD, grad_TD


def methods(T: int, seed: int) -> list[Method]:
    """Every method of one token count (the layers share weights, input and gradient)."""
    moe, base, x_TD, grad_TD = layer_setup(T, seed)
    gmm = dataclasses.replace(moe, experts_impl="plain", gemm_backend="grouped_mm")
    loop = dataclasses.replace(moe, experts_impl="plain", gemm_backend="loop")
    return [raw_grouped_gemms(T, seed),
            layer_method("fused", sharing(base, moe), x_TD, grad_TD),
            layer_method("grouped_mm", sharing(base, gmm), x_TD, grad_TD),
            layer_method("plain", sharing(base, loop), x_TD, grad_TD)]


Measured = tuple[int, str, int, Any, tuple[float, ...], tuple[float, ...]]
"""(T, method, FLOPs per call, time (p20, p50, p80) in ms, GFLOP/s (p20, p50, p80), per-round
raw ÷ method time (p20, p50, p80))."""


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
"""``wall``: elapsed seconds; ``thread``: the calling thread's CPU seconds (user + system),
which a busy machine's other processes do not inflate (meaningful with ``--threads 1``)."""


def measure_all(tokens: list[int], seed: int, repeats: int, warmup: int,
                clock: str = "wall") -> list[Measured]:
    """Time every method at every T (methods interleaved within a T); print each result.

    Raises:
        RuntimeError: when a method fails (e.g. ``torch._grouped_mm`` missing).
    """
    measured: list[Measured] = []
    for T in tokens:
        flops = 18 * T * K * D * N
        results = run_methods(methods(T, seed), repeats=repeats, warmup=warmup, measure=False,
                              clock=CLOCKS[clock])
        raw = next(res for res in results if res.name == "raw_grouped_gemms").times_s["full"]
        for res in results:
            if res.error:
                raise RuntimeError(f"{res.name} at T={T}: {res.error}")
            rates = percentiles([flops / t / 1e9 for t in res.times_s["full"]])
            ratios = percentiles([r / t for r, t in zip(raw, res.times_s["full"], strict=True)])
            measured.append((T, res.name, flops, res.time_ms("full"), rates, ratios))
            print(f"T={T:6d} {res.name:18s} {res.time_ms('full')[1]:9.1f} ms "
                  f"{rates[1]:6.1f} GFLOP/s {ratios[1]:6.3f}x raw rate", flush=True)
    return measured


GEMM_OPS = ("aten::mm", "aten::addmm_", "aten::addmm", "aten::bmm")


def profile_ops(T: int, seed: int, top: int = 12) -> list[tuple[str, str, float]]:
    """Self CPU time per operator of one warm call of each method, from ``torch.profiler``.

    Returns:
        ``(method, operator, milliseconds)`` rows: the ``top`` operators by self time, plus
        ``gemm total`` (matrix products: mm, addmm, bmm), ``other total`` and ``total``.
    """
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for method in methods(T, seed):
        method.zero_grad()
        method.backward(method.forward())  # warm-up
        method.zero_grad()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            method.backward(method.forward())
        self_ms = {ev.key: ev.self_cpu_time_total / 1e3 for ev in prof.key_averages()}
        gemm = sum(v for key, v in self_ms.items() if key in GEMM_OPS)
        total = sum(self_ms.values())
        ranked = sorted(self_ms.items(), key=lambda kv: -kv[1])[:top]
        rows += [(method.name, key, ms) for key, ms in ranked]
        rows += [(method.name, "gemm total", gemm), (method.name, "other total", total - gemm),
                 (method.name, "total", total)]
    return rows


OPTIONS: dict[str, dict[str, Any]] = {
    "--tokens": {"type": int, "nargs": "+", "default": [2048, 4096, 8192, 16384]},
    "--repeats": {"type": int, "default": 5},
    "--warmup": {"type": int, "default": 1},
    "--out": {"default": "benchmarks/results/flops_cpu.csv"},
    "--threads": {"type": int, "default": 1},
    "--seed": {"type": int, "default": 0},
    "--shape": {"choices": tuple(SHAPES), "default": "coarse"},
    "--clock": {"choices": tuple(CLOCKS), "default": "wall",
                "help": "wall: elapsed time; thread: the thread's CPU time (with --threads 1, "
                        "robust to other processes on a shared machine)"},
    "--profile": {"type": int, "default": None, "metavar": "T",
                  "help": "instead: self CPU ms per operator of one call per method at T "
                          "(torch.profiler), written to the CSV as metric self_cpu_time"},
}


def write_profile(T: int, seed: int, out: str, env: Any, load: float) -> None:
    """Profile every method at T (:func:`profile_ops`); print and write the rows."""
    config = {"d": D, "n": N, "E": E, "k": K, "dtype": "float32", "activation": "swiglu",
              "T": T, "load_average_1min_start": round(load, 2), "clock": "self CPU time"}
    rows = []
    for name, op, ms in profile_ops(T, seed):
        print(f"{name:18s} {op:45s} {ms:9.1f} ms")
        rows.append(csv_row(benchmark="flops_profile", method=name, mode="full",
                            metric="self_cpu_time", unit="ms", x_name="operator", x_value=op,
                            values=ms, config=config, env=env))
    write_csv(rows, out)
    print(f"wrote {out} (load average {load:.1f} at start)")


def main() -> None:
    """Time every method at every T; print GFLOP/s and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, options in OPTIONS.items():
        parser.add_argument(flag, **options)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    use_shape(args.shape)
    env, load_start = collect_environment("cpu"), os.getloadavg()[0]
    if args.profile is not None:
        write_profile(args.profile, args.seed, args.out, env, load_start)
        return
    if args.clock == "thread" and args.threads != 1:
        parser.error(f"--clock thread needs --threads 1 (got --threads {args.threads}): "
                     "it measures the calling thread only")
    measured = measure_all(args.tokens, args.seed, args.repeats, args.warmup, args.clock)
    config = {"d": D, "n": N, "E": E, "k": K, "dtype": "float32", "activation": "swiglu",
              "repeats": args.repeats, "load_average_1min_start": round(load_start, 2),
              "load_average_1min_end": round(os.getloadavg()[0], 2),
              "flops_per_call": "18*T*k*d*n", "clock": args.clock}
    rows = []
    for T, name, flops, time_ms, rates, ratios in measured:
        common = {"benchmark": "flops", "method": name, "mode": "full", "x_name": "tokens",
                  "x_value": T, "config": config, "env": env}
        rows += [csv_row(metric="time" if args.clock == "wall" else "thread_cpu_time",
                         unit="ms", values=time_ms, **common),
                 csv_row(metric="gflops", unit="GFLOP/s", values=rates, **common),
                 csv_row(metric="rate_vs_raw", unit="ratio", values=ratios, **common),
                 csv_row(metric="flops", unit="FLOP", values=flops, **common)]
    write_csv(rows, args.out)
    print(f"wrote {args.out} (load average {load_start:.1f} at start, "
          f"{config['load_average_1min_end']:.1f} at end)")


if __name__ == "__main__":
    main()
