"""MemFine at CPU scale: memory and speed of one MoE transformer block as routing skew grows.

MemFine's comparison (arXiv 2511.21431, Table 4), side by side in one run, on one block
(attention + MoE, memfine's ``nn.model.Block``) fed the same input, weights and routing:

- ``full_recompute``: no chunks, the whole block recomputed in backward (``recompute="full"``, c=1);
- ``fixed_c8``: c = 8 token chunks, the expert part recomputed chunk by chunk (``experts``);
- ``mact``: c chosen per step from a memory budget (MACT, Eq. 8-9), ``experts`` recompute;
- ``no_recompute``: no chunks, nothing recomputed (c = 1, ``none``).

Skew on one CPU: the block plays one rank of an expert-parallel group of size ``--ep``. Its MoE
layer holds experts 0..E/ep-1 and sees the group's tokens; slots routed to the other ranks'
experts become sentinels (computed elsewhere), so s″ = rows routed to the local experts, from
T·k/ep (balanced) up to T·k (every token sends both slots here: MemFine's worst case). The skew
is set with the experiment knob ``MoEConfig.skew_hot_experts``/``skew_bias`` (a selection bias on
the local experts), calibrated to hit each target share; ``skew`` = s″ / (T·k/ep).

The MACT budget covers the MoE layer: s′_max = 1.25·T·k/ep rows (Eq. 8 with memfine's memory
model), so the balanced case runs in one chunk and the worst needs four.

Metrics (CSV, docs/style.md §6 columns, one row per provider, skew level and metric):
``block_peak_bytes`` and ``moe_peak_bytes`` (peak live bytes of forward + backward of the block,
and of its MoE layer alone, above what existed before; CPU storage tracker), ``saved_bytes``
(bytes the block holds for backward: alive at the end of forward, output excluded),
``time`` (forward + backward of the block, ms, p20/p50/p80 over repetitions interleaved by the
shared harness, :func:`memfine.bench.harness.run_methods`), ``tokens_per_s`` (T / time, per
call) and ``num_chunks`` (c chosen), plus ``budget_bytes``; rows as
:func:`memfine.bench.results.csv_row` writes them.

Usage: ``python benchmarks/bench_memfine.py [--reps 5] [--seq 512] [--out PATH]``; writes the CSV
and a PNG next to it. It runs with one intra-op thread by default: with other jobs on the cores,
multi-threaded matmuls wait on each other and times vary several-fold. Run it twice.
Legend: B batch, Q sequence, T = B·Q tokens, D = d, K = k, E experts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from memfine.bench.harness import Method, MethodResult, run_methods
from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.measure.peak import PeakMemoryTracker
from memfine.nn.experts import GroupedExperts
from memfine.nn.model import Block
from memfine.nn.moe import MoELayer
from memfine.schedule.policy import ChunkPolicy

BENCHMARK = "memfine"
PROVIDERS = ("full_recompute", "fixed_c8", "mact", "no_recompute")
SHARES = (0.25, 0.4, 0.6, 0.8, 1.0)  # targets for the share of slots on the local experts
MEMORY_METRICS = ("block_peak_bytes", "moe_peak_bytes", "saved_bytes")


def model_config(args: argparse.Namespace, chunk: ChunkConfig, skew_bias: float = 0.0
                 ) -> ModelConfig:
    """The one-block model of the benchmark (skew knob on the ``E/ep`` local experts)."""
    local = args.experts // args.ep
    moe = MoEConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                    num_experts=args.experts, top_k=args.top_k, skew_hot_experts=local,
                    skew_bias=skew_bias)
    return ModelConfig(num_layers=1, num_heads=args.heads, max_seq_len=args.seq, moe=moe,
                       chunk=chunk)


class LocalRankExperts(GroupedExperts):
    """Experts that compute only experts 0..num_local-1: other slots become sentinels."""

    def __init__(self, config: MoEConfig, num_local: int) -> None:
        super().__init__(config)
        self.num_local = num_local

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, int]:
        local_TK = torch.where(top_k_index < self.num_local, top_k_index,
                               self.config.num_experts)
        return super().run(x_TD, local_TK, top_k_weights, policy)


def local_rank_view(layer: MoELayer, num_local: int) -> None:
    """Make ``layer`` compute only experts 0..num_local-1 (its experts swapped, weights kept)."""
    view = LocalRankExperts(layer.config, num_local)
    view.w_up, view.w_down = layer.experts.w_up, layer.experts.w_down
    layer.experts = view


def calibrate(block: Block, x_BQD: torch.Tensor, share: float, num_local: int) -> float:
    """Selection bias on the local experts that puts ``share`` of all slots on them."""
    with torch.no_grad():
        normed = block._attention_part(x_BQD)[1].reshape(-1, x_BQD.shape[-1])
        router = block.moe.router

        def share_of(bias: float) -> float:
            router.selection_bias.zero_()
            router.selection_bias[:num_local] = bias
            return float((router(normed).top_k_index < num_local).float().mean())

        lo, hi = 0.0, 2.0
        if share_of(lo) >= share:
            return 0.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share_of(mid) < share else (lo, mid)
        router.selection_bias.zero_()
    return hi


def build(args: argparse.Namespace, chunk: ChunkConfig, bias: float,
          state: dict[str, torch.Tensor]) -> Block:
    """A block with the shared weights, the given chunking and skew, as one EP rank."""
    block = Block(model_config(args, chunk, bias))
    state = {k: v for k, v in state.items() if k != "moe.router.selection_bias"}
    block.load_state_dict(state, strict=False)
    local_rank_view(block.moe, args.experts // args.ep)
    return block


def block_method(name: str, block: Block, x: torch.Tensor, grad: torch.Tensor) -> Method:
    """A harness method: one forward + backward of ``block`` (loss = output·grad + aux) on a
    fresh leaf copy of x, gradients set to ``None`` first; the extra ``num_chunks`` is c."""
    state: dict[str, Any] = {"num_chunks": 0}

    def zero_grad() -> None:
        block.zero_grad(set_to_none=True)
        state["x"] = x.detach().requires_grad_(True)

    def forward() -> Any:
        out, aux = block(state["x"])
        state["num_chunks"] = aux.num_chunks
        return out, aux

    def backward(res: Any) -> None:
        out, aux = res
        torch.autograd.backward([out, aux.load_balancing_loss], [grad, torch.ones(())])

    return Method(name=name, forward=forward, backward=backward, zero_grad=zero_grad,
                  tokens=x.shape[0] * x.shape[1],
                  extras=lambda: {"num_chunks": (state["num_chunks"], "chunks")})


def memory(block: Block, x: torch.Tensor, grad: torch.Tensor) -> dict[str, int]:
    """Block peak and saved bytes, and the MoE layer's own peak (fresh gradients each time)."""
    x = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    with PeakMemoryTracker() as tracker:
        out, aux = block(x)
        saved = tracker.mark("forward") - out.untyped_storage().nbytes()
        torch.autograd.backward([out, aux.load_balancing_loss], [grad, torch.ones(())])
    block_peak = tracker.peak_bytes
    with torch.no_grad():
        normed = block._attention_part(x)[1].detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    with PeakMemoryTracker() as tracker:
        moe_out, aux = block.moe(normed)
        torch.autograd.backward([moe_out, aux.load_balancing_loss], [grad, torch.ones(())])
    return {"block_peak_bytes": block_peak, "moe_peak_bytes": tracker.peak_bytes,
            "saved_bytes": saved}


def run_level(args: argparse.Namespace, share: float, budget: int, x: torch.Tensor,
              grad: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Every provider at one skew level: memory once, then interleaved timed repetitions.

    Returns:
        provider → the memory metrics (bytes), ``result`` (its :class:`MethodResult`),
        ``num_chunks``, ``skew``, ``recv_rows`` and ``bias``.
    """
    chunks = {"full_recompute": ChunkConfig(num_chunks=1, recompute="full"),
              "fixed_c8": ChunkConfig(num_chunks=8, recompute="experts"),
              "mact": ChunkConfig(memory_budget_bytes=budget, recompute="experts"),
              "no_recompute": ChunkConfig(num_chunks=1, recompute="none")}
    probe = build(args, chunks["no_recompute"], 0.0, state)
    bias = calibrate(probe, x, share, args.experts // args.ep)
    blocks = {name: build(args, chunks[name], bias, state) for name in PROVIDERS}
    with torch.no_grad():
        normed = blocks["mact"]._attention_part(x)[1].reshape(-1, args.hidden)
        routed = blocks["mact"].moe.router(normed).top_k_index
    local_rows = int((routed < args.experts // args.ep).sum())
    T = x.shape[0] * x.shape[1]
    memories = {name: memory(block, x, grad) for name, block in blocks.items()}
    timed = run_methods([block_method(name, blocks[name], x, grad) for name in PROVIDERS],
                        repeats=args.reps, warmup=args.warmup, measure=False)
    skew = local_rows / (T * args.top_k / args.ep)
    return {res.name: {**memories[res.name], "result": res, "num_chunks":
                       res.extras["num_chunks"][0], "skew": skew, "recv_rows": local_rows,
                       "bias": bias} for res in timed}


def _p50_ms(res: MethodResult) -> float:
    return res.time_ms()[1]  # type: ignore[index]


def to_rows(args: argparse.Namespace, budget: int, levels: list[dict[str, dict[str, Any]]]
            ) -> list[dict[str, str]]:
    """CSV rows (docs/style.md §6 columns)."""
    env = collect_environment("cpu")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    rows = []
    for level in levels:
        for name, res in level.items():
            timed: MethodResult = res["result"]
            metrics = [("time", "ms", "full", timed.time_ms()),
                       ("tokens_per_s", "tokens/s", "full", timed.tokens_per_s()),
                       ("num_chunks", "chunks", "fwd", res["num_chunks"]),
                       ("budget_bytes", "bytes", "fwd", budget)]
            metrics += [(m, "bytes", "full", res[m]) for m in MEMORY_METRICS]
            rows += [csv_row(benchmark=BENCHMARK, provider=name, mode=mode, metric=metric,
                             unit=unit, x_name="skew", x_value=f"{res['skew']:.3f}",
                             values=values, config={**config, "recv_rows": res["recv_rows"],
                                                    "skew_bias": res["bias"]}, env=env)
                     for metric, unit, mode, values in metrics]
    return rows


def print_level(level: dict[str, dict[str, Any]], budget: int, T: int) -> None:
    """One line per provider: c, peaks, saved, time, tokens/s, time relative to full recompute."""
    first = next(iter(level.values()))
    print(f"skew {first['skew']:.2f}× balanced (s''={first['recv_rows']} rows), "
          f"MoE budget {budget / 2**20:.2f} MiB")
    base = _p50_ms(level["full_recompute"]["result"])
    for name, res in level.items():
        p50 = _p50_ms(res["result"])
        mib = {m: res[m] / 2**20 for m in MEMORY_METRICS}
        print(f"  {name:<15} c={res['num_chunks']!s:<2} block peak {mib['block_peak_bytes']:7.2f}"
              f" MiB  moe peak {mib['moe_peak_bytes']:7.2f} MiB  saved {mib['saved_bytes']:7.2f}"
              f" MiB  time {p50:7.1f} ms  {T / (p50 / 1e3):8.0f} tokens/s  "
              f"time/full_recompute {p50 / base:5.3f}")


def plot(levels: list[dict[str, dict[str, Any]]], budget: int, T: int, path: Path) -> None:
    """Four panels against skew: block peak, MoE peak (with the budget), saved bytes, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    skews = [float(next(iter(lv.values()))["skew"]) for lv in levels]
    styles = {"full_recompute": ("o", "-"), "fixed_c8": ("s", "--"), "mact": ("^", "-"),
              "no_recompute": ("x", ":")}
    for name in PROVIDERS:
        series = [[lv[name][m] / 2**20 for lv in levels] for m in MEMORY_METRICS]
        series.append([T / (_p50_ms(lv[name]["result"]) / 1e3) for lv in levels])
        marker, line = styles[name]
        for ax, ys in zip(axes, series, strict=True):
            ax.plot(skews, ys, marker=marker, linestyle=line, label=name)
        if name == "mact":
            for sk, y, lv in zip(skews, series[3], levels, strict=True):
                axes[3].annotate(f"c={lv[name]['num_chunks']}", (sk, y), fontsize=8,
                                 textcoords="offset points", xytext=(0, 6))
    axes[1].axhline(budget / 2**20, color="k", linestyle="--", label="MACT budget")
    titles = ("block peak (MiB)", "MoE layer peak (MiB)", "block saved for backward (MiB)",
              "block tokens/s")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("skew: received rows / balanced share")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run every skew level, print the tables, write the CSV and the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128, help="d")
    parser.add_argument("--intermediate", type=int, default=256, help="n")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8, help="E (global)")
    parser.add_argument("--top-k", type=int, default=2, help="k (<= E/ep for the worst case)")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel size emulated")
    parser.add_argument("--batch", type=int, default=4, help="B sequences")
    parser.add_argument("--seq", type=int, default=512, help="Q tokens per sequence")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES),
                        help="target shares of the slots on the local experts")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per provider")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default); 1 keeps timings "
                             "stable on a shared machine")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "memfine_cpu.csv")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    state = Block(model_config(args, ChunkConfig())).state_dict()
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    grad = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    T = args.batch * args.seq
    moe = model_config(args, ChunkConfig()).moe
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
    s_max = math.ceil(1.25 * T * args.top_k / args.ep)
    budget = probe.fixed_bytes(T, 4) + s_max * probe.row_bytes(4)
    levels = []
    for share in args.shares:
        level = run_level(args, share, budget, x, grad, state)
        print_level(level, budget, T)
        levels.append(level)
    write_csv(to_rows(args, budget, levels), args.out)
    png = args.out.with_suffix(".png")
    plot(levels, budget, T, png)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
