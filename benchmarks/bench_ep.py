"""Expert-parallel peak memory per rank as routing skew grows: no chunks vs MACT (CPU, gloo).

Each of e spawned ranks (gloo on 127.0.0.1) holds T tokens and E/e experts. A skew s ∈ [0, 1]
sends a random share s of every rank's tokens to experts 0..k-1, all held by rank 0 (the hot
rank); the other tokens pick k distinct experts uniformly. At s = 1 rank 0 receives every row of
the group: e times its balanced share, MemFine's failure case. Per rank and skew, one forward +
backward of the EP experts is measured with :class:`memfine.measure.peak.PeakMemoryTracker`
(peak bytes of tensors created inside the region; x, the routing and the weights exist before).

Methods:
- ``c1_none``: no chunks, no recompute (every received row's saved tensors live until backward);
- ``c1_experts``: no chunks, the expert part recomputed in backward;
- ``mact``: the MemFine chunk policy (:class:`memfine.schedule.policy.ChunkPolicy`) with a byte
  budget that fits the balanced load with c = 1; c is chosen per rank from the received rows s″
  and agreed (maximum) over the EP group; recompute ``experts``.

Output: a printed table, a CSV (docs/style.md §6 columns of :mod:`memfine.bench.results`, with
``threads`` = 1 per rank, plus ``rank``, ``ep_size``, ``budget_bytes``) with metrics
``peak_bytes`` (bytes), ``recv_rows`` (rows), ``num_chunks`` (c) and ``peak_over_budget``
(ratio), and a PNG of peak MiB vs skew per rank with the budget line.
Usage: ``python benchmarks/bench_ep.py [--ep-sizes 2 4] [--tokens 2048] [--out-dir DIR]``.

``--static``: per-rank static memory of the ``small`` language model sharded on a
(dp_shard, ep) mesh with FSDP2 and experts over ``ep`` (:func:`memfine.parallel.shard_model`),
after one AdamW step: parameter, gradient and optimizer-state bytes of every rank's local
shards, measured from the tensors, next to the prediction P·(D_t + D_t + 8)/W (MemFine Eq. 1
with parameters, gradients and AdamW's two fp32 moments all sharded over the W ranks; the
AdamW step counters, one fp32 scalar per tensor, are measured but not predicted). Writes
``ep_static_cpu.csv`` (metrics ``static_bytes``, ``predicted_bytes`` per rank).
Legend: T tokens per rank, K top-k slots, E experts, D = d, N = n.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from memfine._optional import pyplot
from memfine.bench.results import CSV_COLUMNS, collect_environment, csv_row, write_csv
from memfine.config import ChunkConfig, MoEConfig
from memfine.measure.peak import PeakMemoryTracker
from memfine.nn import MoETransformerLM
from memfine.parallel import (
    DistributedTraining,
    ExpertParallelExperts,
    build_context,
    exchange_counts,
)
from memfine.schedule.policy import ChunkPolicy
from memfine.train import preset
from memfine.train.optim import build_optimizer

BENCHMARK = "ep_peak"
METHODS = ("c1_none", "c1_experts", "mact")
COLUMNS = (*CSV_COLUMNS, "rank", "ep_size", "budget_bytes")
RESULTS = Path(__file__).parent / "results"
BALANCED_HEADROOM = 1.25  # the budget fits 1.25× the balanced received rows in one chunk


def skewed_routing(T: int, E: int, k: int, skew: float, g: torch.Generator) -> torch.Tensor:
    """(T, k) int64: a random share ``skew`` of tokens picks experts 0..k-1, the rest uniform."""
    idx_TK = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    hot_T = torch.randperm(T, generator=g)[: round(skew * T)]
    idx_TK[hot_T] = torch.arange(k)
    return idx_TK


def _budget(moe: MoEConfig, tokens: int) -> int:
    """The predicted peak at c = 1 of 1.25× the balanced received rows T·k (exact model)."""
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
    rows = math.ceil(BALANCED_HEADROOM * tokens * moe.top_k)
    return probe.predicted_peak(rows, tokens, 4, 1)


def _measure(module: ExpertParallelExperts, x_TD: torch.Tensor, idx_TK: torch.Tensor,
             w_TK: torch.Tensor, grad_TD: torch.Tensor, policy: ChunkPolicy) -> tuple[int, int]:
    """Peak bytes of one forward + backward, and the chunk count used."""
    for p in (x_TD, w_TK, module.w_up, module.w_down):
        p.grad = None
    with PeakMemoryTracker("cpu") as tracker:
        out, plan = module.run(x_TD, idx_TK, w_TK, policy)
        out.backward(grad_TD)
        del out
    return tracker.peak_bytes, plan.num_chunks


def _worker(rank: int, ep_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep_size, timeout=datetime.timedelta(seconds=300))
    ctx = build_context(1, ep_size)
    E, k, T = args.experts_per_rank * ep_size, args.top_k, args.tokens
    moe = MoEConfig(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                    num_experts=E, top_k=k)
    budget = _budget(moe, T)
    g = torch.Generator().manual_seed(0)
    w_up = torch.randn(E, moe.hidden_size, moe.up_width, generator=g) * 0.05
    w_down = torch.randn(E, moe.intermediate_size, moe.hidden_size, generator=g) * 0.05
    module = ExpertParallelExperts.from_full(w_up, w_down, moe, ctx)
    # the EP experts agree on c over ep themselves (one all-reduce MAX per call)
    runs = {"c1_none": ChunkPolicy(ChunkConfig(num_chunks=1, recompute="none"), moe),
            "c1_experts": ChunkPolicy(ChunkConfig(num_chunks=1, recompute="experts"), moe),
            "mact": ChunkPolicy(ChunkConfig(memory_budget_bytes=budget, recompute="experts",
                                            allow_over_budget=True), moe)}
    records = []
    for skew in args.skews:
        g_rank = torch.Generator().manual_seed(1000 * rank + int(skew * 100))
        x_TD = torch.randn(T, moe.hidden_size, generator=g_rank).requires_grad_()
        idx_TK = skewed_routing(T, E, k, skew, g_rank)
        w_TK = torch.rand(T, k, generator=g_rank).requires_grad_()
        grad_TD = torch.randn(T, moe.hidden_size, generator=g_rank)
        recv = exchange_counts(idx_TK, E, (1,), ctx.ep_group).recv_tokens
        for name in args.methods:
            _measure(module, x_TD, idx_TK, w_TK, grad_TD, runs[name])  # warm-up
            peak, c = _measure(module, x_TD, idx_TK, w_TK, grad_TD, runs[name])
            records.append({"method": name, "skew": skew, "rank": rank, "peak_bytes": peak,
                            "num_chunks": c, "recv_rows": recv})
    gathered: list[Any] = [None] * ep_size
    dist.all_gather_object(gathered, records)
    if rank == 0:
        meta = {"ep_size": ep_size, "budget_bytes": budget, "moe": moe.to_dict(),
                "tokens_per_rank": T}
        Path(out).write_text(json.dumps({"meta": meta,
                                         "records": [r for rs in gathered for r in rs]}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ep_size(ep_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Spawn ``ep_size`` gloo ranks, measure every skew and method; return meta + records."""
    out = RESULTS / f".ep_{ep_size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(ep_size, _free_port(), args, str(out)), nprocs=ep_size,
                       start_method="spawn", join=True)
    data: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return data


def to_rows(data: dict[str, Any]) -> list[dict[str, str]]:
    """CSV rows (:data:`COLUMNS`): one per (rank, skew, method, metric)."""
    env = dataclasses.replace(collect_environment("cpu"), threads=1)  # the ranks' thread count
    meta = data["meta"]
    budget = meta["budget_bytes"]
    extra = {"ep_size": str(meta["ep_size"]), "budget_bytes": str(budget)}
    rows = []
    for r in data["records"]:
        metrics = [("peak_bytes", "bytes", r["peak_bytes"]), ("recv_rows", "rows", r["recv_rows"]),
                   ("num_chunks", "chunks", r["num_chunks"]),
                   ("peak_over_budget", "ratio", r["peak_bytes"] / budget)]
        rows += [{**csv_row(benchmark=BENCHMARK, method=r["method"], mode="full",
                            metric=metric, unit=unit, x_name="skew", x_value=f"{r['skew']:g}",
                            values=value, config=meta, env=env),
                  "rank": str(r["rank"]), **extra} for metric, unit, value in metrics]
    return rows


def print_table(data: dict[str, Any]) -> None:
    """Per skew and rank: received rows, then peak MiB (and c) of every method."""
    meta, mib = data["meta"], 2**20
    print(f"ep={meta['ep_size']}  T={meta['tokens_per_rank']} per rank  "
          f"budget {meta['budget_bytes'] / mib:.2f} MiB")
    by_key: dict[tuple[float, int], dict[str, Any]] = {}
    for r in data["records"]:
        by_key.setdefault((r["skew"], r["rank"]), {})[r["method"]] = r
    for (skew, rank), provs in sorted(by_key.items()):
        recv = next(iter(provs.values()))["recv_rows"]
        cells = "  ".join(f"{name} {p['peak_bytes'] / mib:7.2f} MiB (c={p['num_chunks']})"
                          for name, p in provs.items())
        print(f"  skew {skew:4.2f} rank {rank}: s''={recv:6d}  {cells}")


def plot(datas: list[dict[str, Any]], path: Path) -> None:
    """Peak MiB vs skew, one panel per EP size: hot rank solid, a cold rank dashed, budget line."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(datas), figsize=(6 * len(datas), 4.2), squeeze=False)
    for ax, data in zip(axes[0], datas, strict=True):
        meta, mib = data["meta"], 2**20
        for i, name in enumerate(METHODS):
            for rank, style in ((0, "-"), (meta["ep_size"] - 1, "--")):
                pts = sorted((r["skew"], r["peak_bytes"] / mib) for r in data["records"]
                             if r["method"] == name and r["rank"] == rank)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", color=f"C{i}",
                            label=f"{name} rank {rank}{' (hot)' if rank == 0 else ''}")
        ax.axhline(meta["budget_bytes"] / mib, color="k", lw=1, ls=":", label="MACT budget")
        ax.set(title=f"EP size {meta['ep_size']}, T={meta['tokens_per_rank']} tokens per rank",
               xlabel="skew (share of tokens sent to rank 0's experts)",
               ylabel="peak bytes of EP experts fwd+bwd (MiB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _static_worker(rank: int, layout: tuple[int, int], port: int, out: str) -> None:
    torch.set_num_threads(1)
    world = layout[0] * layout[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    config = preset("small")
    torch.manual_seed(0)
    model = MoETransformerLM(config.model)
    num_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        DistributedTraining(build_context(*layout)).prepare_model(model)
    optimizer, _ = build_optimizer(model, config)
    x_BQ = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(x_BQ, x_BQ).loss.backward()
    optimizer.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    record = {"rank": rank, "parameter_bytes": params, "gradient_bytes": grads,
              "optimizer_state_bytes": state, "static_bytes": params + grads + state,
              "predicted_bytes": num_params * (4 + 4 + 8) // world, "num_params": num_params}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_static(args: argparse.Namespace) -> list[dict[str, str]]:
    """Spawn every layout; print the table; return the CSV rows."""
    env = dataclasses.replace(collect_environment("cpu"), threads=1)
    rows, mib = [], 2**20
    print("layout (dp_shard, ep)  W  measured MiB per rank (params + grads + AdamW)  "
          "predicted MiB  measured/predicted (max rank)")
    for layout in LAYOUTS:
        out = RESULTS / f".static_{layout[0]}x{layout[1]}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        mp.start_processes(_static_worker, args=(layout, _free_port(), str(out)),
                           nprocs=layout[0] * layout[1], start_method="spawn", join=True)
        records = json.loads(out.read_text())
        out.unlink()
        measured = [r["static_bytes"] for r in records]
        predicted = records[0]["predicted_bytes"]
        print(f"  {str(layout):20s}  {len(records)}  "
              f"{' '.join(f'{m / mib:6.3f}' for m in measured):40s}  {predicted / mib:6.3f}  "
              f"{max(measured) / predicted:.3f}")
        meta = {"layout": list(layout), "preset": "small", "num_params": records[0]["num_params"]}
        for r in records:
            rows += [{**csv_row(benchmark="ep_static", method="fsdp2_ep", mode="full",
                                metric=metric, unit="bytes", x_name="world_size",
                                x_value=str(len(records)), values=r[metric], config=meta,
                                env=env),
                      "rank": str(r["rank"]), "ep_size": str(layout[1]), "budget_bytes": ""}
                     for metric in ("static_bytes", "predicted_bytes", "parameter_bytes",
                                    "gradient_bytes", "optimizer_state_bytes")]
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every EP size; print tables, write the CSV and the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens T per rank")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--static", action="store_true",
                        help="per-rank static memory of each mesh layout instead")
    args = parser.parse_args(argv)
    if args.static:
        path = args.out_dir / "ep_static_cpu.csv"
        write_csv(run_static(args), path, columns=COLUMNS)
        print(f"wrote {path}")
        return 0
    datas = [run_ep_size(e, args) for e in args.ep_sizes]
    rows = []
    for data in datas:
        print_table(data)
        rows += to_rows(data)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out_dir / "ep_peak_cpu.csv", args.out_dir / "ep_peak_cpu.png"
    write_csv(rows, csv_path, columns=COLUMNS)
    plot(datas, png_path)
    print(f"wrote {csv_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
