"""Expert path benchmark: fwd+bwd time and saved-for-backward bytes, fused vs plain vs loop.

Providers (same routing, weights and incoming gradient; the index build is inside the timed region):
- ``fused``: :func:`memfine.ops.run_experts` with ``impl="fused"`` (MoEBlaze Function, saves x + H);
- ``plain``: ``impl="plain"``, autograd over the gathered copy, A, Y and the (T, k, d) scattered
  copy;
- ``expert_loop``: the per-expert mask loop most PyTorch MoE code writes (HF "eager" style:
  ``torch.where`` per expert, gather, two matmuls, weighted ``index_add_``;
  :func:`memfine.bench.layers.expert_loop`).

Configurations: MoEBlaze Table 1 (docs/design.md §3; n = 4d, SwiGLU) with the same d, E, k and
batch × seq product scaled down to fit 2 CPU cores. The shared harness
(:func:`memfine.bench.harness.run_methods`) runs the providers interleaved (one repetition of
each in turn, rotating the order), so load changes on a shared machine hit all of them alike.

Output: one printed table per configuration (``memfine bench``'s,
:func:`memfine.bench.output.print_point`; ratios against ``fused``) and a CSV
(docs/style.md §6 columns, :mod:`memfine.bench.results`) with, per configuration and provider,
``time`` (modes ``fwd``, ``bwd`` and ``full`` = forward + backward, unit ms, p20/p50/p80 over
repetitions), ``tokens_per_s``, ``saved_bytes`` and ``peak_bytes`` (unit bytes; one measurement,
repeated in p20/p50/p80; no memory-model prediction: "not modelled"), plus ``saved_over_floor``
(unit ratio; floor = (T·d + 2·T·k·n) elements, docs/design.md §5).

Usage: ``python benchmarks/bench_experts.py [--reps 5] [--confs 1 2 5] [--out PATH]``.
Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from memfine.bench.harness import Method, MethodResult, run_methods
from memfine.bench.layers import add_ratios, expert_loop
from memfine.bench.options import Point
from memfine.bench.output import print_point
from memfine.bench.results import collect_environment, result_rows, write_csv
from memfine.dispatch import build_routing_index
from memfine.ops import run_experts
from memfine.units import format_bytes

BENCHMARK = "experts"

@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertsBenchConfig:
    """One benchmark point: a MoEBlaze Table 1 configuration at a reduced token count.

    Attributes:
        conf: Table 1 row number.
        hidden_size: d.
        num_experts: E.
        top_k: k.
        num_tokens: T = batch × seq after scaling down.
        paper_tokens: batch × seq in the paper.
        dtype: ``float32`` or ``bfloat16``.
    """

    conf: int
    hidden_size: int
    num_experts: int
    top_k: int
    num_tokens: int
    paper_tokens: int
    dtype: str = "float32"

    @property
    def intermediate_size(self) -> int:
        """n = 4d (Table 1: ffn = 4d)."""
        return 4 * self.hidden_size


# Table 1 (d, E, k, batch·seq); T chosen so one fwd+bwd is ≈ 20-40 GFLOP (18·T·k·d·n).
TABLE1 = {
    1: ExpertsBenchConfig(conf=1, hidden_size=512, num_experts=4, top_k=1, num_tokens=1024,
                          paper_tokens=32 * 2048),
    2: ExpertsBenchConfig(conf=2, hidden_size=1024, num_experts=8, top_k=2, num_tokens=256,
                          paper_tokens=32 * 2048),
    3: ExpertsBenchConfig(conf=3, hidden_size=1024, num_experts=16, top_k=4, num_tokens=128,
                          paper_tokens=32 * 2048),
    5: ExpertsBenchConfig(conf=5, hidden_size=512, num_experts=16, top_k=4, num_tokens=512,
                          paper_tokens=32 * 1024),
}

Inputs = dict[str, torch.Tensor]
Provider = Callable[[Inputs], torch.Tensor]


def make_inputs(cfg: ExpertsBenchConfig, seed: int = 0) -> Inputs:
    """Random routing (softmax top-k of random logits), weights and an incoming gradient.

    Returns:
        dict with x (T, d), top_k_index (T, k) int64, top_k_weights (T, k), w_up (E, d, 2n),
        w_down (E, n, d) (all float leaves requiring grad) and grad_out (T, d).
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    T, D, N, E, k = (cfg.num_tokens, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts,
                     cfg.top_k)
    scores_TE = torch.randn(T, E, generator=gen).softmax(-1)
    weights_TK, index_TK = scores_TE.topk(k, dim=-1)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    return {
        "x": leaf(T, D), "top_k_index": index_TK,
        "top_k_weights": weights_TK.to(dtype).requires_grad_(),
        "w_up": leaf(E, D, 2 * N, scale=D ** -0.5), "w_down": leaf(E, N, D, scale=N ** -0.5),
        "grad_out": torch.randn(T, D, generator=gen).to(dtype),
    }


def _memfine_provider(impl: str) -> Provider:
    def run(inp: Inputs) -> torch.Tensor:
        index = build_routing_index(inp["top_k_index"], inp["w_up"].shape[0])
        return run_experts(inp["x"], inp["top_k_weights"], index, inp["w_up"], inp["w_down"],
                           impl=impl)  # type: ignore[arg-type]

    return run


def _expert_loop(inp: Inputs) -> torch.Tensor:
    return expert_loop(inp["x"], inp["top_k_index"], inp["top_k_weights"], inp["w_up"],
                       inp["w_down"])


PROVIDERS: dict[str, Provider] = {
    "fused": _memfine_provider("fused"),
    "plain": _memfine_provider("plain"),
    "expert_loop": _expert_loop,
}


def provider_method(name: str, inp: Inputs) -> Method:
    """A harness method: provider ``name`` forward, backward from ``grad_out``; the expert
    weights are left out of the saved bytes (they are parameters)."""
    provider = PROVIDERS[name]
    leaves = [t for key, t in inp.items() if key != "grad_out" and t.requires_grad]

    def zero_grad() -> None:
        for t in leaves:
            t.grad = None

    return Method(name=name, forward=lambda: provider(inp),
                  backward=lambda out: out.backward(inp["grad_out"]), zero_grad=zero_grad,
                  tokens=inp["x"].shape[0], exclude=lambda: [inp["w_up"], inp["w_down"]])


def floor_bytes(cfg: ExpertsBenchConfig) -> int:
    """(T·d + 2·T·k·n) elements × bytes per element: the no-recompute floor (docs/design.md §5)."""
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    T, D, N, k = cfg.num_tokens, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    return (T * D + 2 * T * k * N) * itemsize


def bench_config(cfg: ExpertsBenchConfig, providers: list[str], reps: int, warmup: int = 1
                 ) -> list[MethodResult]:
    """Saved bytes and interleaved fwd+bwd times of every provider on one configuration."""
    inp = make_inputs(cfg)
    results = run_methods([provider_method(name, inp) for name in providers], repeats=reps,
                          warmup=warmup)
    add_ratios(results, floor_bytes=floor_bytes(cfg))
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--confs", type=int, nargs="+", default=[1, 2, 3, 5],
                        choices=sorted(TABLE1), help="MoEBlaze Table 1 rows (default: 1 2 3 5)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS),
                        choices=list(PROVIDERS), help="providers (default: all)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per provider")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="multiply every configuration's token count T by this")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "bench_experts_cpu.csv",
                        help="CSV path")
    args = parser.parse_args(argv)
    env, rows = collect_environment("cpu"), []
    for conf in args.confs:
        base = TABLE1[conf]
        num_tokens = max(1, round(base.num_tokens * args.token_scale))
        cfg = ExpertsBenchConfig(**{**asdict(base), "dtype": args.dtype, "num_tokens": num_tokens})
        results = bench_config(cfg, list(args.providers), args.reps, args.warmup)
        config = {**asdict(cfg), "intermediate_size": cfg.intermediate_size,
                  "activation": "swiglu"}
        label = (f"conf {cfg.conf}: d={cfg.hidden_size} n={cfg.intermediate_size} "
                 f"E={cfg.num_experts} k={cfg.top_k} T={cfg.num_tokens} (paper "
                 f"{cfg.paper_tokens}) {cfg.dtype}; x + H floor {format_bytes(floor_bytes(cfg))}")
        print_point(Point(suite=BENCHMARK, x_name="table1_conf", x_value=str(cfg.conf),
                          label=label, config=config, results=results, reference="fused"))
        rows += result_rows(results, benchmark=BENCHMARK, x_name="table1_conf", x_value=cfg.conf,
                            config=config, env=env)
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
