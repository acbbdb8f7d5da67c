"""Expert path benchmark: fwd+bwd time and saved-for-backward bytes, fused vs plain vs loop.

Providers (same routing, weights and incoming gradient; the index build is inside the timed region):
- ``fused``: :func:`memfine.ops.run_experts` with ``impl="fused"`` (MoEBlaze Function, saves x + H);
- ``plain``: ``impl="plain"``, autograd over the gathered copy, A, Y and the (T, k, d) scattered
  copy;
- ``expert_loop``: the per-expert mask loop most PyTorch MoE code writes (HF "eager" style:
  ``torch.where`` per expert, gather, two matmuls, weighted ``index_add_``).

Configurations: MoEBlaze Table 1 (DESIGN.md §3; ffn n = 4d, SwiGLU) with the same d, E, k and the
batch × seq product scaled down to fit 2 CPU cores. Providers run interleaved (one repetition of
each in turn, rotating the order), so load changes on a shared machine hit all of them alike.

Output: one printed table and a CSV (STYLE.md §6 columns) with, per configuration and provider,
``time`` (mode ``full`` = forward + backward, unit ms, p20/p50/p80 over repetitions) and
``saved_bytes`` (unit bytes; one measurement, repeated in p20/p50/p80), plus ``saved_over_floor``
(unit ratio; floor = (T·d + 2·T·k·n) elements, DESIGN.md §5).

Usage: ``python benchmarks/bench_experts.py [--reps 5] [--confs 1 2 5] [--out PATH]``.
Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import memfine
from memfine.dispatch import build_routing_index
from memfine.measure.saved import track_saved_tensors
from memfine.ops import run_experts
from memfine.ops.activations import apply_activation

BENCHMARK = "experts"
CSV_COLUMNS = ("benchmark", "provider", "mode", "metric", "unit", "x_name", "x_value", "p20",
               "p50", "p80", "device", "torch_version", "threads", "memfine_version", "git_sha",
               "utc_timestamp", "config_json")


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


def expert_loop(inp: Inputs) -> torch.Tensor:
    """Per-expert mask loop (HF eager style): where → gather → matmuls → weighted index_add_."""
    x_TD, index_TK, weights_TK = inp["x"], inp["top_k_index"], inp["top_k_weights"]
    out_TD = torch.zeros_like(x_TD)
    for e in range(inp["w_up"].shape[0]):
        token_R, slot_R = torch.where(index_TK == e)
        if token_R.numel() == 0:
            continue
        a_RN = apply_activation(x_TD[token_R] @ inp["w_up"][e], "swiglu")
        y_RD = (a_RN @ inp["w_down"][e]) * weights_TK[token_R, slot_R, None]
        out_TD = out_TD.index_add(0, token_R, y_RD)
    return out_TD


PROVIDERS: dict[str, Provider] = {
    "fused": _memfine_provider("fused"),
    "plain": _memfine_provider("plain"),
    "expert_loop": expert_loop,
}


def _leaves(inp: Inputs) -> list[torch.Tensor]:
    return [t for name, t in inp.items() if name != "grad_out" and t.requires_grad]


def fwd_bwd(provider: Provider, inp: Inputs) -> float:
    """One forward + backward, in seconds (grads are cleared first)."""
    for t in _leaves(inp):
        t.grad = None
    start = time.perf_counter()
    provider(inp).backward(inp["grad_out"])
    return time.perf_counter() - start


def saved_bytes(provider: Provider, inp: Inputs) -> int:
    """Bytes saved for backward by one forward (expert weights excluded: they are parameters)."""
    with track_saved_tensors(exclude=[inp["w_up"], inp["w_down"]]) as saved:
        out = provider(inp)
    del out
    return saved.total_bytes


def floor_bytes(cfg: ExpertsBenchConfig) -> int:
    """(T·d + 2·T·k·n) elements × bytes per element: the no-recompute floor (DESIGN.md §5)."""
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    T, D, N, k = cfg.num_tokens, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    return (T * D + 2 * T * k * N) * itemsize


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(p20, p50, p80) by linear interpolation."""
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([0.2, 0.5, 0.8],
                                                                        dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def bench_config(cfg: ExpertsBenchConfig, providers: list[str], reps: int, warmup: int = 1
                 ) -> dict[str, dict[str, object]]:
    """Saved bytes and interleaved fwd+bwd times of every provider on one configuration.

    Returns:
        provider → {"saved_bytes": int, "times_ms": list[float]}.
    """
    inp = make_inputs(cfg)
    results: dict[str, dict[str, object]] = {
        name: {"saved_bytes": saved_bytes(PROVIDERS[name], inp), "times_ms": []}
        for name in providers}
    for rep in range(warmup + reps):
        shift = rep % len(providers)
        for name in providers[shift:] + providers[:shift]:
            elapsed_ms = fwd_bwd(PROVIDERS[name], inp) * 1e3
            if rep >= warmup:
                results[name]["times_ms"].append(elapsed_ms)  # type: ignore[union-attr]
    return results


def environment() -> dict[str, str]:
    """Device, versions, thread count, git SHA and UTC time for the CSV rows."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain")
                                                     else "")
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown"
    return {
        "device": f"cpu:{platform.machine()}", "torch_version": torch.__version__,
        "threads": str(torch.get_num_threads()), "memfine_version": memfine.__version__,
        "git_sha": sha,
        "utc_timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def to_rows(cfg: ExpertsBenchConfig, results: dict[str, dict[str, object]]) -> list[dict[str, str]]:
    """CSV rows (STYLE.md §6 columns) for one configuration."""
    env = environment()
    config_json = json.dumps({**asdict(cfg), "intermediate_size": cfg.intermediate_size,
                              "activation": "swiglu"}, sort_keys=True)
    rows = []
    for name, res in results.items():
        times = res["times_ms"]
        saved = int(res["saved_bytes"])  # type: ignore[call-overload]
        p20, p50, p80 = (f"{q:.6g}" for q in quantiles(times))  # type: ignore[arg-type]
        ratio = f"{saved / floor_bytes(cfg):.6g}"
        metrics = [("time", "ms", (p20, p50, p80)),
                   ("saved_bytes", "bytes", (str(saved),) * 3),  # exact integer bytes
                   ("saved_over_floor", "ratio", (ratio,) * 3)]
        for metric, unit, (q20, q50, q80) in metrics:
            rows.append({"benchmark": BENCHMARK, "provider": name,
                         "mode": "full" if metric == "time" else "fwd", "metric": metric,
                         "unit": unit, "x_name": "table1_conf", "x_value": str(cfg.conf),
                         "p20": q20, "p50": q50, "p80": q80, **env, "config_json": config_json})
    return rows


def write_csv(rows: list[dict[str, str]], path: Path) -> None:
    """Write rows with the STYLE.md §6 header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def print_table(cfg: ExpertsBenchConfig, results: dict[str, dict[str, object]]) -> None:
    """One line per provider: p50 time, saved MiB, saved/floor, time and saved ratio to fused."""
    base = results.get("fused")
    print(f"conf {cfg.conf}: d={cfg.hidden_size} n={cfg.intermediate_size} E={cfg.num_experts} "
          f"k={cfg.top_k} T={cfg.num_tokens} (paper {cfg.paper_tokens}) {cfg.dtype}")
    for name, res in results.items():
        p20, p50, p80 = quantiles(res["times_ms"])  # type: ignore[arg-type]
        saved = int(res["saved_bytes"])  # type: ignore[call-overload]
        line = (f"  {name:<12} time p50 {p50:8.1f} ms [p20 {p20:7.1f}, p80 {p80:7.1f}]  "
                f"saved {saved / 2**20:8.2f} MiB  saved/floor {saved / floor_bytes(cfg):5.2f}")
        if base is not None and name != "fused":
            base_p50 = quantiles(base["times_ms"])[1]  # type: ignore[arg-type]
            line += (f"  time/fused {p50 / base_p50:5.2f}  "
                     f"saved/fused {saved / int(base['saved_bytes']):5.2f}")  # type: ignore[call-overload]
        print(line)


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
    rows: list[dict[str, str]] = []
    for conf in args.confs:
        base = TABLE1[conf]
        num_tokens = max(1, round(base.num_tokens * args.token_scale))
        cfg = ExpertsBenchConfig(**{**asdict(base), "dtype": args.dtype, "num_tokens": num_tokens})
        results = bench_config(cfg, list(args.providers), args.reps, args.warmup)
        print_table(cfg, results)
        rows += to_rows(cfg, results)
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
