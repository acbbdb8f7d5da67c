"""torch.compile and autocast on one MoE layer (CPU): time ratios, saved and peak bytes.

Rows (``provider``): eager fp32, compiled fp32 (inductor, capture_scalar_outputs), eager under
torch.autocast(bf16) with fp32 master weights; then the streamed fused backward with row blocks
of ``--block-rows`` rows, eager and compiled (``*_blocks``; under compile the backward is one
block by default) and compiled with the traced row blocks (``compiled_fp32_streamed``,
``memfine.experts.function.STREAM_UNDER_COMPILE`` on); then c = 2 chunks with per-chunk
recompute, eager and compiled (``*_c2``). Each: forward + backward of the layer, timed with
:func:`memfine.bench.harness.cpu_clock`: the calling thread's CPU time (``time.thread_time``) at
one torch intra-op thread (``--threads 1``, the default; inductor's CPU kernels then run on the
calling thread too), else the wall clock, named in the CSV's ``clock`` column. A compiled variant
needs Dynamo's caches reset before it (the row-block flag is read while tracing), so variants
cannot alternate call by call; instead ``--rounds`` rounds each build, warm up (two calls; the
first compiled call compiles, from inductor's cache after the first round) and time every
variant ``--repeats`` times, the variants in a rotated order per round
(:func:`memfine.bench.harness.interleaved_order`). ``fwd_bwd_s`` is the median over rounds of
each round's median; its ``ratio_to_eager_fp32`` the median over rounds of the ratio to eager
fp32's median in the same round. ``saved_bytes``: the
bytes saved for backward by one forward (saved-tensor hooks, parameters left out; a compiled
graph's saved tensors pass through the hooks where its autograd Function saves them);
``peak_bytes``: the peak live bytes of one forward + backward from ``torch.profiler``'s allocator
events (the live-storage tracker cannot see inductor's buffers). The machine's 1-minute load
average at the start and the end is written as ``load_average`` rows (provider ``machine``).
Writes benchmarks/results/compile_cpu.csv (one row per method and metric, units and versions).

    python benchmarks/bench_compile.py [--tokens 512] [--rounds 5] [--repeats 5] [--threads 1]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

import memfine
from memfine.bench.harness import cpu_clock, interleaved_order
from memfine.config import ChunkConfig, MoEConfig, backward_block_rows
from memfine.experts import function as fused_function
from memfine.measure import SavedTensorsTracker, profiled_peak_bytes
from memfine.nn import MoELayer

OUT = Path(__file__).parent / "results" / "compile_cpu.csv"
D, N, E, K = 128, 256, 8, 2
COLUMNS = ["benchmark", "provider", "metric", "unit", "value", "ratio_to_eager_fp32", "tokens",
           "config", "torch", "memfine", "threads", "clock", "rounds", "git_sha", "utc"]
METRICS = (("fwd_bwd_s", "s"), ("saved_bytes", "bytes"), ("peak_bytes", "bytes"))


def _step(fn: Callable, layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> None:
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    out, aux = fn(x)
    torch.autograd.backward([out, aux.load_balancing_loss, aux.z_loss],
                            [grad.to(out.dtype), torch.ones(()), torch.ones(())])


def _region(autocast: bool) -> AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()


def _measure(fn: Callable, layer: MoELayer, x: torch.Tensor, grad: torch.Tensor,
             repeats: int, autocast: bool, clock: Callable[[], float], memory: bool
             ) -> dict[str, float]:
    """Median fwd+bwd seconds (``clock``); with ``memory``, the saved bytes of one forward and
    the profiler peak of one forward + backward."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for _ in range(2):
            with _region(autocast):
                _step(fn, layer, x, grad)
        times = []
        for _ in range(repeats):
            t0 = clock()
            with _region(autocast):
                _step(fn, layer, x, grad)
            times.append(clock() - t0)
        if not memory:
            return {"fwd_bwd_s": statistics.median(times)}
        with _region(autocast), SavedTensorsTracker(exclude=layer.parameters()) as saved:
            fn(x)
        with _region(autocast):
            peak = profiled_peak_bytes(lambda: _step(fn, layer, x, grad))
    return {"fwd_bwd_s": statistics.median(times), "saved_bytes": saved.total_bytes,
            "peak_bytes": peak}


def _variants(args: argparse.Namespace) -> dict[str, tuple[MoEConfig, ChunkConfig | None,
                                                           bool, bool]]:
    """name → (MoE config, chunk config, compiled, autocast)."""
    base = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    row_bytes = (3 * D + 3 * N + 2 * N) * 4  # one row of a backward block (SwiGLU, fp32)
    blocks = MoEConfig(**{**base.to_dict(), "backward_block_bytes": args.block_rows * row_bytes})
    c2 = ChunkConfig(num_chunks=2, recompute="experts")
    return {"eager_fp32": (base, None, False, False),
            "compiled_fp32": (base, None, True, False),
            "eager_autocast_bf16": (base, None, False, True),
            "eager_fp32_blocks": (blocks, None, False, False),
            "compiled_fp32_blocks": (blocks, None, True, False),
            "compiled_fp32_streamed": (blocks, None, True, False),
            "eager_fp32_c2": (base, c2, False, False),
            "compiled_fp32_c2": (base, c2, True, False)}


def _config_text(moe: MoEConfig, chunk: ChunkConfig | None) -> str:
    rows = backward_block_rows(moe.backward_block_bytes, D, N, 2 * N, 4)
    c = chunk.num_chunks if chunk is not None else 1
    streamed = int(fused_function.STREAM_UNDER_COMPILE)
    return (f"d={D},n={N},E={E},k={K},swiglu,fused,block_rows={rows},c={c},"
            f"stream_compiled={streamed}")


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every variant")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT, help="CSV path")
    parser.add_argument("--block-rows", type=int, default=256,
                        help="rows per block of the *_blocks rows' streamed backward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock_name, clock = cpu_clock(args.threads)
    load_start = _load()
    x = torch.randn(args.tokens, D, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    grad = torch.randn(args.tokens, D, generator=torch.Generator().manual_seed(2))
    variants = _variants(args)
    measured: dict[str, dict[str, float]] = {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    configs: dict[str, str] = {}
    for r in range(args.rounds):
        for name in interleaved_order(list(variants), r):
            moe, chunk, compiled, autocast = variants[name]
            fused_function.STREAM_UNDER_COMPILE = name.endswith("_streamed")
            torch.manual_seed(0)
            layer = MoELayer(moe, chunk=chunk)
            fn = torch.compile(layer) if compiled else layer
            result = _measure(fn, layer, x, grad, args.repeats, autocast, clock,
                              memory=name not in measured)
            times[name].append(result.pop("fwd_bwd_s"))
            measured.setdefault(name, result)
            configs[name] = _config_text(moe, chunk)
            torch._dynamo.reset()
    fused_function.STREAM_UNDER_COMPILE = False
    base = times["eager_fp32"]
    rows = {name: ({**measured[name], "fwd_bwd_s": statistics.median(times[name])},
                   statistics.median(t / b for t, b in zip(times[name], base, strict=True)),
                   configs[name]) for name in variants}
    _write(rows, args, load_start, _load(), clock_name)


def _write(rows: dict[str, tuple[dict[str, float], float, str]], args: argparse.Namespace,
           load_start: float, load_end: float, clock: str) -> None:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=False).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tail = [torch.__version__, getattr(memfine, "__version__", ""), args.threads, sha, stamp]
    base = rows["eager_fp32"][0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for name, (row, time_ratio, config) in rows.items():
            for metric, unit in METRICS:
                timed = metric == "fwd_bwd_s"
                ratio = time_ratio if timed else row[metric] / base[metric]
                w.writerow(["compile_layer", name, metric, unit, f"{row[metric]:.6g}",
                            f"{ratio:.4f}", args.tokens, config, *tail[:3],
                            *((clock, args.rounds) if timed else ("", "")), *tail[3:]])
            print(f"{name:22s} {row['fwd_bwd_s'] * 1e3:9.2f} ms ({time_ratio:.3f}x)  saved "
                  f"{row['saved_bytes']:,.0f} B ({row['saved_bytes'] / base['saved_bytes']:.3f}x)"
                  f"  peak {row['peak_bytes']:,.0f} B "
                  f"({row['peak_bytes'] / base['peak_bytes']:.3f}x)  {config}")
        for when, value in (("start", load_start), ("end", load_end)):
            w.writerow(["compile_layer", "machine", f"load_average_1m_{when}", "processes",
                        f"{value:.2f}", "", args.tokens, "", *tail[:3], "", "", *tail[3:]])
    print(f"load average (1 min) {load_start:.2f} at the start, {load_end:.2f} at the end")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
