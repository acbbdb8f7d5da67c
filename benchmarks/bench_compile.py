"""torch.compile and autocast on one MoE layer (CPU): time ratios, saved and peak bytes.

Rows (``provider``): eager fp32, compiled fp32 (inductor, capture_scalar_outputs), eager under
torch.autocast(bf16) with fp32 master weights; then the streamed fused backward with row blocks
of ``--block-rows`` rows, eager and compiled (``*_blocks``; under compile the backward is one
block by default) and compiled with the traced row blocks (``compiled_fp32_streamed``,
``memfine.experts.function.STREAM_UNDER_COMPILE`` on); then c = 2 chunks with per-chunk
recompute, eager and compiled (``*_c2``). Each: forward + backward of the layer, median of
``--repeats`` after two warm-up calls (the first compiled call compiles), timed with
:func:`memfine.bench.harness.cpu_clock`: the calling thread's CPU time (``time.thread_time``) at
one torch intra-op thread (``--threads 1``, the default; inductor's CPU kernels then run on the
calling thread too), else the wall clock, named in the CSV's ``clock`` column. The variants are
timed one after another, not interleaved: each compiled variant needs Dynamo's caches reset
before it (the row-block flag is read while tracing). ``saved_bytes``: the
bytes saved for backward by one forward (saved-tensor hooks, parameters left out; a compiled
graph's saved tensors pass through the hooks where its autograd Function saves them);
``peak_bytes``: the peak live bytes of one forward + backward from ``torch.profiler``'s allocator
events (the live-storage tracker cannot see inductor's buffers). The machine's 1-minute load
average at the start and the end is written as ``load_average`` rows (provider ``machine``).
Writes benchmarks/results/compile_cpu.csv (one row per method and metric, units and versions).

    python benchmarks/bench_compile.py [--tokens 512] [--repeats 5] [--threads 1] [--out PATH]
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
from memfine.bench.harness import cpu_clock
from memfine.config import ChunkConfig, MoEConfig, backward_block_rows
from memfine.experts import function as fused_function
from memfine.measure import SavedTensorsTracker, profiled_peak_bytes
from memfine.nn import MoELayer

OUT = Path(__file__).parent / "results" / "compile_cpu.csv"
D, N, E, K = 128, 256, 8, 2
COLUMNS = ["benchmark", "provider", "metric", "unit", "value", "ratio_to_eager_fp32", "tokens",
           "config", "torch", "memfine", "threads", "clock", "git_sha", "utc"]
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
             repeats: int, autocast: bool, clock: Callable[[], float]) -> dict[str, float]:
    """Median fwd+bwd seconds (``clock``), saved bytes of one forward, profiler peak of one."""
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
    parser.add_argument("--repeats", type=int, default=5)
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
    rows: dict[str, tuple[dict[str, float], str]] = {}
    for name, (moe, chunk, compiled, autocast) in _variants(args).items():
        fused_function.STREAM_UNDER_COMPILE = name.endswith("_streamed")
        torch.manual_seed(0)
        layer = MoELayer(moe, chunk=chunk)
        fn = torch.compile(layer) if compiled else layer
        rows[name] = (_measure(fn, layer, x, grad, args.repeats, autocast, clock),
                      _config_text(moe, chunk))
        torch._dynamo.reset()
    fused_function.STREAM_UNDER_COMPILE = False
    _write(rows, args, load_start, _load(), clock_name)


def _write(rows: dict[str, tuple[dict[str, float], str]], args: argparse.Namespace,
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
        for name, (row, config) in rows.items():
            for metric, unit in METRICS:
                w.writerow(["compile_layer", name, metric, unit, f"{row[metric]:.6g}",
                            f"{row[metric] / base[metric]:.4f}", args.tokens, config, *tail[:3],
                            clock if metric == "fwd_bwd_s" else "", *tail[3:]])
            print(f"{name:22s} {row['fwd_bwd_s'] * 1e3:9.2f} ms "
                  f"({row['fwd_bwd_s'] / base['fwd_bwd_s']:.3f}x)  saved "
                  f"{row['saved_bytes']:,.0f} B ({row['saved_bytes'] / base['saved_bytes']:.3f}x)"
                  f"  peak {row['peak_bytes']:,.0f} B "
                  f"({row['peak_bytes'] / base['peak_bytes']:.3f}x)  {config}")
        for when, value in (("start", load_start), ("end", load_end)):
            w.writerow(["compile_layer", "machine", f"load_average_1m_{when}", "processes",
                        f"{value:.2f}", "", args.tokens, "", *tail[:3], "", *tail[3:]])
    print(f"load average (1 min) {load_start:.2f} at the start, {load_end:.2f} at the end")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
