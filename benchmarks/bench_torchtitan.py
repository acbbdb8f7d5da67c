"""torchtitan MoE block: fwd+bwd time and saved bytes, torchtitan's experts vs memfine inside it.

One MoE block of torchtitan's qwen3, deepseek_v3 and gpt_oss models (built by each model's own layer
builder, tests/integrations/torchtitan_models.py; weights ~ N(0, 1/fan_in)), called on the same
input and incoming gradient by:
- ``torchtitan``: the block as torchtitan builds it (argsort dispatcher, permuted copy of x,
  ``GroupedExperts`` over ``torch._grouped_mm`` in bf16, fp32 scaling and scatter-add combine);
- ``memfine``: the same block after ``memfine.integrations.torchtitan.convert_model`` (buffer-free
  dispatch, fused experts saving x + H);
- ``memfine_c4``: with 4 token chunks and per-chunk recompute;
- ``memfine_mact``: with a memory budget (MACT picks c per call; the budget is printed).
Router, shared experts and routed scaling are torchtitan's in every method.

Methods run interleaved in one process (the order rotates per round) and are timed with the
calling thread's CPU time (``time.thread_time``) at one torch intra-op thread (``--threads 1``, the
default), which other processes on a shared machine do not inflate; with more threads the
harness times with the wall clock and the CSV says so (:func:`memfine.bench.harness.cpu_clock`).

Metrics (CSV, docs/style.md §6 columns, :mod:`memfine.bench.results`): ``time`` ms p20/p50/p80
(modes ``fwd``, ``bwd``, ``full``), ``time_ratio_to_torchtitan`` (p20/p50/p80 over the rounds of
the method's time ÷ torchtitan's in the same round), ``tokens_per_s``, ``saved_bytes`` and
``peak_bytes`` of the whole block (bytes), plus extras: ``routed_saved_bytes`` (bytes saved by
the routed-experts part alone, router run outside the tracker), ``routed_saved_over_floor``
(ratio to the x + H floor (T·d + 2·T·k·n)·D_t of docs/design.md §5) and ``num_chunks`` (c;
MACT's choice for its budget). ``config_json`` holds the ``clock``, the ``rounds`` and
``load_average_1min`` (the machine's 1-minute load average when the config finished).
Parameters are fp32 or bf16. torchtitan's ``GroupedExperts`` casts to bf16 for its GEMMs whatever
the parameters' dtype, while memfine computes in the parameters' dtype, so with fp32 parameters
the two run GEMMs of different precision (and different speed on a CPU).

Usage: ``python benchmarks/bench_torchtitan.py [--configs ...] [--reps 5] [--threads 1]
[--out PATH]``.
Legend: T tokens, K top-k slots, E experts, D = d, N = n.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "integrations"))

from torchtitan_models import build_moe, routed_saved_bytes  # noqa: E402

from memfine.baselines.layers import add_ratios  # noqa: E402
from memfine.bench.harness import Method, MethodResult, run_methods  # noqa: E402
from memfine.bench.options import Point  # noqa: E402
from memfine.bench.output import print_point  # noqa: E402
from memfine.bench.results import collect_environment, point_rows, write_csv  # noqa: E402
from memfine.integrations.torchtitan import convert_model  # noqa: E402
from memfine.train.loop import torch_threads  # noqa: E402
from memfine.units import format_bytes  # noqa: E402

BENCHMARK = "torchtitan_moe"
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    dtype: str
    tokens: int  # T = batch 2 × tokens / 2
    dim: int
    hidden: int
    num_experts: int
    top_k: int
    budget: str  # MACT budget of memfine_mact

    def floor_bytes(self) -> int:
        element = torch.finfo(getattr(torch, self.dtype)).bits // 8
        return (self.tokens * self.dim + 2 * self.tokens * self.top_k * self.hidden) * element


CONFIGS = {s.name: s for s in (
    Shape(name="qwen3_fp32", model="qwen3", dtype="float32", tokens=512, dim=256, hidden=128,
          num_experts=16, top_k=4, budget="20MiB"),
    Shape(name="qwen3_bf16", model="qwen3", dtype="bfloat16", tokens=512, dim=256, hidden=128,
          num_experts=16, top_k=4, budget="10MiB"),
    Shape(name="deepseek_v3_fp32", model="deepseek_v3_sigmoid_scaled", dtype="float32",
          tokens=512, dim=256, hidden=128, num_experts=16, top_k=4, budget="20MiB"),
    # torchtitan's GPT-OSS block runs on CPU in bf16 only (its combine cannot scatter bf16 rows
    # into fp32 tokens)
    Shape(name="gpt_oss_bf16", model="gpt_oss", dtype="bfloat16", tokens=512, dim=256,
          hidden=128, num_experts=16, top_k=4, budget="10MiB"),
)}
PROVIDERS = ("torchtitan", "memfine", "memfine_c4", "memfine_mact")
REFERENCE = "torchtitan"  # the time ratios' reference


def _num_chunks(moe: torch.nn.Module, x: torch.Tensor) -> int | None:
    """c of memfine's last call (MACT: from its chunk policy, s″ = T·k rows); None: torchtitan."""
    routed = moe.routed_experts
    options = getattr(routed, "memfine_config", None)
    if options is None:
        return None
    policy = getattr(getattr(routed, "_memfine_gate", None), "_memfine_chunk_policy", None)
    if policy is None:
        return options.chunk.num_chunks
    T = x.shape[0] * x.shape[1]
    return policy.num_chunks(T * moe.router.top_k, T, x.element_size())


def _method(name: str, moe: torch.nn.Module, x: torch.Tensor, g: torch.Tensor,
            floor: int) -> Method:
    def forward() -> torch.Tensor:
        return moe(x)

    def backward(out: torch.Tensor) -> None:
        out.backward(g)

    def zero_grad() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None

    def extras() -> dict[str, tuple[float | int | None, str]]:
        routed = routed_saved_bytes(moe, x)
        return {"routed_saved_bytes": (routed, "bytes"),
                "routed_saved_over_floor": (routed / floor, "ratio"),
                "num_chunks": (_num_chunks(moe, x), "chunks")}

    return Method(name=name, forward=forward, backward=backward, zero_grad=zero_grad,
                  tokens=x.shape[0] * x.shape[1], exclude=lambda: list(moe.buffers()),
                  extras=extras)


def bench_config(shape: Shape, providers: list[str], reps: int, warmup: int
                 ) -> list[MethodResult]:
    """Memory and interleaved fwd+bwd times of every provider on one block."""
    dtype = getattr(torch, shape.dtype)
    base = build_moe(shape.model, dtype=dtype, dim=shape.dim, hidden=shape.hidden,
                     num_experts=shape.num_experts, top_k=shape.top_k)
    torch.manual_seed(1)
    x = torch.randn(2, shape.tokens // 2, shape.dim, dtype=dtype, requires_grad=True)
    g = torch.randn(2, shape.tokens // 2, shape.dim, dtype=dtype)
    options = {"torchtitan": None, "memfine": {}, "memfine_c4": {"num_chunks": 4},
               "memfine_mact": {"memory_budget": shape.budget}}
    methods = []
    for name in providers:
        moe = copy.deepcopy(base)
        if options[name] is not None:
            convert_model(moe, **options[name])
        methods.append(_method(name, moe, x, g, shape.floor_bytes()))
    results = run_methods(methods, repeats=reps, warmup=warmup, device="cpu")
    add_ratios(results, floor_bytes=shape.floor_bytes())
    return results


def run(args: argparse.Namespace) -> list[dict[str, str]]:
    """Run every config of ``args``: print each table, return the CSV rows."""
    env, rows = collect_environment("cpu"), []
    for name in args.configs:
        shape = CONFIGS[name]
        config = {**asdict(shape), "torchtitan_version": version("torchtitan"),
                  "warmup": args.warmup}
        results = bench_config(shape, list(args.providers), args.reps, args.warmup)
        label = (f"{shape.model} MoE block, T {shape.tokens}, d {shape.dim}, n {shape.hidden}, "
                 f"E {shape.num_experts}, k {shape.top_k}, {shape.dtype}, "
                 f"{torch.get_num_threads()} thread(s); x + H floor "
                 f"{format_bytes(shape.floor_bytes())}; MACT budget {shape.budget}")
        point = Point(suite=BENCHMARK, x_name="config", x_value=name, label=label,
                      config=config, results=results, reference=REFERENCE)
        print_point(point)
        for res in results:
            if res.error is not None:
                print(f"{res.name} failed: {res.error}")
        rows += point_rows(point, env, failed=False)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per provider")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: thread CPU time; more: the wall clock)")
    parser.add_argument("--out", type=Path, default=RESULTS / "torchtitan_cpu.csv")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    with torch_threads(args.threads):
        rows = run(args)
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
