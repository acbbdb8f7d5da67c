"""Expert weight gradients of the streamed fused backward: per-expert ``addmm_`` vs grouped GEMM.

Times, on the CPU with one thread (thread CPU time, the ``clock`` column; the two methods
interleaved, the first alternating per round; medians of per-round ratios; the 1-minute load
average after each configuration in ``load_average_1min``), dW[e] = X_eᵀ·dH_e over the
S = T·k expert-grouped rows streamed in row blocks:

- ``addmm_loop``: per block, one ``addmm_`` per expert present into one buffer
  (:func:`memfine.ops.weight_grads.accumulate_grouped_weight_grad_`);
- ``grouped_mm``: per block, one ``torch._grouped_mm`` (2-D × 2-D, offsets along the rows); the
  first block's product is the buffer, later ones are added into it.

Shapes: the coarse d 512, n 1024, E 16, k 4 and the fine-grained d 512, n 128, E 64, k 8, T 4096,
fp32 and bf16, block bytes 16 MiB (the default), 64 MiB and one block.
Output: ``benchmarks/results/weight_grads_cpu.csv`` (ms per call, ratio grouped ÷ loop).
Usage: ``nice python benchmarks/bench_weight_grads.py [--out PATH]``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch

import memfine
from memfine.bench.harness import THREAD_CPU, interleaved_order
from memfine.config import backward_block_rows
from memfine.ops.weight_grads import accumulate_grouped_weight_grad_

OUT = Path(__file__).parent / "results" / "weight_grads_cpu.csv"
SHAPES = [(512, 1024, 16, 4, 4096), (512, 128, 64, 8, 4096)]  # d, n, E, k, T
ROUNDS = 5


def _problem(d: int, n: int, E: int, k: int, T: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
    offsets = torch.zeros(E + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(ids, minlength=E).cumsum(0)
    x = torch.randn(T * k, d, dtype=dtype, generator=g)
    dh = torch.randn(T * k, 2 * n, dtype=dtype, generator=g)
    return x, dh, offsets.int(), offsets.tolist()


def _loop(x: torch.Tensor, dh: torch.Tensor, bounds: list[int], rows: int) -> torch.Tensor:
    E = len(bounds) - 1
    grad = torch.empty(E, x.shape[1], dh.shape[1], dtype=x.dtype)
    unwritten = [True] * E
    for r0 in range(0, x.shape[0], rows):
        r1 = min(x.shape[0], r0 + rows)
        accumulate_grouped_weight_grad_(grad, x[r0:r1], dh[r0:r1], bounds, r0,
                                        unwritten=unwritten)
    return grad


def _grouped(x: torch.Tensor, dh: torch.Tensor, offsets: torch.Tensor, rows: int
             ) -> torch.Tensor:
    grad = None
    for r0 in range(0, x.shape[0], rows):
        r1 = min(x.shape[0], r0 + rows)
        ends = (offsets[1:] - r0).clamp_(0, r1 - r0)
        part = torch._grouped_mm(x[r0:r1].t(), dh[r0:r1], offs=ends)
        grad = part if grad is None else grad.add_(part)
    assert grad is not None
    return grad


def main() -> None:
    """Time both methods at every shape, dtype and block size; write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="CSV path")
    out = parser.parse_args().out
    torch.set_num_threads(1)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=False).stdout.strip()
    rows_out = []
    for d, n, E, k, T in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            dt = torch.empty((), dtype=dtype).element_size()
            x, dh, offsets, bounds = _problem(d, n, E, k, T, dtype)
            for block_bytes in (16 * 2**20, 64 * 2**20, 2**62):
                rows = backward_block_rows(block_bytes, d, n, 2 * n, dt)
                _loop(x, dh, bounds, rows), _grouped(x, dh, offsets, rows)  # warm-up
                calls = {"loop": partial(_loop, x, dh, bounds, rows),
                         "grouped": partial(_grouped, x, dh, offsets, rows)}
                seconds: dict[str, list[float]] = {"loop": [], "grouped": []}
                for r in range(ROUNDS):
                    for name in interleaved_order(list(calls), r):
                        t0 = time.thread_time()
                        calls[name]()
                        seconds[name].append(time.thread_time() - t0)
                loop_s, grouped_s = seconds["loop"], seconds["grouped"]
                ratios = [g / lo for g, lo in zip(grouped_s, loop_s, strict=True)]
                row = {"d": d, "n": n, "E": E, "k": k, "T": T, "dtype": str(dtype),
                       "block_bytes": block_bytes, "blocks": -(-T * k // rows),
                       "addmm_loop_ms": round(statistics.median(loop_s) * 1e3, 2),
                       "grouped_mm_ms": round(statistics.median(grouped_s) * 1e3, 2),
                       "ratio_grouped_over_loop": round(statistics.median(ratios), 3),
                       "threads": 1, "clock": THREAD_CPU, "rounds": ROUNDS,
                       "load_average_1min": round(os.getloadavg()[0], 2),
                       "torch": torch.__version__, "memfine": memfine.__version__,
                       "git_sha": sha}
                print(row, flush=True)
                rows_out.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)


if __name__ == "__main__":
    main()
