"""transformers experts block: fwd+bwd time and saved bytes, "memfine" vs "eager" vs "grouped_mm".

One ``Qwen3MoeExperts`` module (transformers' own class, random weights) is called through its
experts interface with each implementation, on the same hidden states, routing and incoming
gradient:
- ``hf_eager``: transformers' per-expert loop (``experts_implementation="eager"``);
- ``hf_grouped_mm``: transformers' sort + ``torch._grouped_mm`` path (its CPU default);
- ``memfine``: ``experts_implementation="memfine"`` (fused MoEBlaze path, saves x + H);
- ``memfine_c4``: the same with 4 token chunks and per-chunk recompute (saves x + routing).
The routing (top-k of a softmax over random logits; weights require grad, as a router's do) is
outside the timed region; the index build of memfine and the sort of grouped_mm are inside.

Configurations (Qwen3-MoE-shaped, fp32): ``tiny`` (d 128, n 64, E 8, k 2, T 512) and ``mid``
(Qwen3-30B-A3B's k 8 and n/d ratio at reduced size: d 768, n 256, E 32, k 8, T 512). Providers run
interleaved, rotating the order, so load changes on a shared machine hit all of them alike.

Output: a printed table, a CSV (STYLE.md §6 columns; metrics ``time`` ms p20/p50/p80, mode
``full`` = forward + backward; ``saved_bytes`` bytes; ``saved_over_floor`` ratio with floor =
(T·d + T·k·2n) elements, the x + H floor of DESIGN.md §5) and a PNG with both metrics.

Usage: ``python benchmarks/bench_hf.py [--configs tiny mid] [--reps 5] [--out PATH]``.
Legend: T tokens, K top-k slots, E experts, D = d, N = n.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_experts import environment, quantiles, write_csv  # noqa: E402

from memfine.integrations.transformers import make_config, memfine_experts_forward  # noqa: E402
from memfine.integrations.transformers import register as register_memfine  # noqa: E402
from memfine.measure.saved import track_saved_tensors  # noqa: E402

BENCHMARK = "hf_experts"
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True, kw_only=True, slots=True)
class HFBenchConfig:
    """One benchmark point.

    Attributes:
        name: ``tiny`` or ``mid``.
        hidden_size: d.
        intermediate_size: n (``moe_intermediate_size``).
        num_experts: E.
        top_k: k.
        num_tokens: T.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_tokens: int


CONFIGS = {
    "tiny": HFBenchConfig(name="tiny", hidden_size=128, intermediate_size=64, num_experts=8,
                          top_k=2, num_tokens=512),
    "mid": HFBenchConfig(name="mid", hidden_size=768, intermediate_size=256, num_experts=32,
                         top_k=8, num_tokens=512),
}
Inputs = dict[str, torch.Tensor]
Provider = Callable[[torch.nn.Module, Inputs], torch.Tensor]


def make_experts(cfg: HFBenchConfig, seed: int = 0) -> torch.nn.Module:
    """A transformers ``Qwen3MoeExperts`` with N(0, 0.02²) weights, fp32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=cfg.hidden_size,
                            moe_intermediate_size=cfg.intermediate_size,
                            num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k)
    torch.manual_seed(seed)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.02)
    return experts


def make_inputs(cfg: HFBenchConfig, seed: int = 0) -> Inputs:
    """Hidden states, a softmax top-k routing and an incoming gradient (fixed by ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    T, D, E, k = cfg.num_tokens, cfg.hidden_size, cfg.num_experts, cfg.top_k
    x_TD = torch.randn(T, D, generator=gen).requires_grad_(True)
    probs_TE = torch.randn(T, E, generator=gen).softmax(-1)
    weights_TK, index_TK = probs_TE.topk(k, dim=-1)
    weights_TK = (weights_TK / weights_TK.sum(-1, keepdim=True)).requires_grad_(True)
    return {"x": x_TD, "top_k_index": index_TK, "top_k_weights": weights_TK,
            "grad_out": torch.randn(T, D, generator=gen)}


def _hf(impl: str) -> Provider:
    def run(experts: torch.nn.Module, inp: Inputs) -> torch.Tensor:
        experts.config._experts_implementation = impl
        return experts(inp["x"], inp["top_k_index"], inp["top_k_weights"])

    return run


def _memfine(**options: object) -> Provider:
    config = make_config(**options)  # type: ignore[arg-type]

    def run(experts: torch.nn.Module, inp: Inputs) -> torch.Tensor:
        return memfine_experts_forward(experts, inp["x"], inp["top_k_index"],
                                       inp["top_k_weights"], config=config)

    return run


PROVIDERS: dict[str, Provider] = {
    "hf_eager": _hf("eager"),
    "hf_grouped_mm": _hf("grouped_mm"),
    "memfine": _memfine(),
    "memfine_c4": _memfine(num_chunks=4),
}


def _clear(experts: torch.nn.Module, inp: Inputs) -> None:
    for t in [*experts.parameters(), inp["x"], inp["top_k_weights"]]:
        t.grad = None


def fwd_bwd_ms(provider: Provider, experts: torch.nn.Module, inp: Inputs) -> float:
    """One forward + backward, in ms."""
    _clear(experts, inp)
    start = time.perf_counter()
    provider(experts, inp).backward(inp["grad_out"])
    return 1e3 * (time.perf_counter() - start)


def saved_bytes(provider: Provider, experts: torch.nn.Module, inp: Inputs) -> int:
    """Bytes saved for backward by one forward (parameters left out)."""
    with track_saved_tensors(exclude=experts.parameters()) as saved:
        out = provider(experts, inp)
    del out
    return saved.total_bytes


def floor_bytes(cfg: HFBenchConfig) -> int:
    """(T·d + T·k·2n) fp32 elements: x + H (DESIGN.md §5)."""
    T, D, N, k = cfg.num_tokens, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    return 4 * (T * D + T * k * 2 * N)


def bench_config(cfg: HFBenchConfig, providers: list[str], reps: int, warmup: int
                 ) -> dict[str, dict[str, object]]:
    """Saved bytes and interleaved fwd+bwd times of every provider (a failing one is reported)."""
    experts, inp = make_experts(cfg), make_inputs(cfg)
    results: dict[str, dict[str, object]] = {}
    for name in providers:
        try:
            results[name] = {"saved_bytes": saved_bytes(PROVIDERS[name], experts, inp),
                             "times_ms": []}
        except RuntimeError as err:  # e.g. grouped_mm alignment rules
            print(f"  {name}: failed: {err}")
    live = list(results)
    for rep in range(warmup + reps):
        shift = rep % len(live)
        for name in live[shift:] + live[:shift]:
            elapsed = fwd_bwd_ms(PROVIDERS[name], experts, inp)
            if rep >= warmup:
                results[name]["times_ms"].append(elapsed)  # type: ignore[union-attr]
    return results


def to_rows(cfg: HFBenchConfig, results: dict[str, dict[str, object]]) -> list[dict[str, str]]:
    """CSV rows (STYLE.md §6 columns) for one configuration."""
    env, config_json = environment(), json.dumps(asdict(cfg), sort_keys=True)
    rows = []
    for name, res in results.items():
        saved = int(res["saved_bytes"])  # type: ignore[call-overload]
        metrics = [("time", "ms", quantiles(res["times_ms"])),  # type: ignore[arg-type]
                   ("saved_bytes", "bytes", (saved,) * 3),
                   ("saved_over_floor", "ratio", (saved / floor_bytes(cfg),) * 3)]
        for metric, unit, (p20, p50, p80) in metrics:
            rows.append({"benchmark": BENCHMARK, "provider": name,
                         "mode": "full" if metric == "time" else "fwd", "metric": metric,
                         "unit": unit, "x_name": "config", "x_value": cfg.name,
                         "p20": f"{p20:.6g}", "p50": f"{p50:.6g}", "p80": f"{p80:.6g}",
                         **env, "config_json": config_json})
    return rows


def print_table(cfg: HFBenchConfig, results: dict[str, dict[str, object]]) -> None:
    """p50 time, saved MiB, saved/floor and the ratios to memfine, one line per provider."""
    print(f"{cfg.name}: d={cfg.hidden_size} n={cfg.intermediate_size} E={cfg.num_experts} "
          f"k={cfg.top_k} T={cfg.num_tokens} fp32, {torch.get_num_threads()} threads")
    base = quantiles(results["memfine"]["times_ms"])[1] if "memfine" in results else None
    for name, res in results.items():
        p20, p50, p80 = quantiles(res["times_ms"])  # type: ignore[arg-type]
        saved = int(res["saved_bytes"])  # type: ignore[call-overload]
        line = (f"  {name:<14} time p50 {p50:8.1f} ms [p20 {p20:7.1f}, p80 {p80:7.1f}]  saved "
                f"{saved / 2**20:8.2f} MiB  saved/floor {saved / floor_bytes(cfg):5.2f}")
        if base is not None:
            line += f"  time/memfine {p50 / base:5.2f}"
        print(line)


def plot(rows: list[dict[str, str]], path: Path) -> None:
    """Bar charts of p50 time and saved MiB per configuration and provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["x_value"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = ((axes[0], "time", 1.0, "fwd+bwd p50 (ms)"),
              (axes[1], "saved_bytes", 2.0**-20, "saved for backward (MiB)"))
    for ax, metric, scale, label in panels:
        width = 0.8 / len(providers)
        for i, prov in enumerate(providers):
            values = [next((float(r["p50"]) * scale for r in rows if r["x_value"] == c
                            and r["provider"] == prov and r["metric"] == metric), 0.0)
                      for c in configs]
            ax.bar([j + i * width for j in range(len(configs))], values, width, label=prov)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))], configs)
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("transformers Qwen3-MoE experts block, CPU fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table, write the CSV and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS),
                        choices=list(PROVIDERS))
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per provider")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_experts_cpu.csv",
                        help="CSV path; the plot goes next to it (.png)")
    args = parser.parse_args(argv)
    register_memfine()
    rows: list[dict[str, str]] = []
    for name in args.configs:
        cfg = CONFIGS[name]
        results = bench_config(cfg, list(args.providers), args.reps, args.warmup)
        print_table(cfg, results)
        rows += to_rows(cfg, results)
    write_csv(rows, args.out)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
