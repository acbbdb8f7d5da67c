"""Measured against predicted peak bytes of one MoE layer's forward + backward, case by case.

    gpu_check_peak.py OUT_CSV SUMMARY_CSV --device cuda [--tiny]

Each case is one :class:`memfine.nn.MoELayer` (dtype, c, recompute mode; MACT under a budget)
measured by the benchmark harness (``memfine.bench.harness.run_methods``: on CUDA
``torch.cuda.max_memory_allocated`` after a reset, with x and the parameters allocated before
the call and left out; on the CPU the live-storage tracker, plus torch.profiler's peak) against
:func:`memfine.memory.layer.moe_layer_memory` at the chunk count the layer ran. The cases are
those of ``tests/gpu/test_cuda_layer.py`` (d 512, n 384, E 16, k 4, T 4096) and the
Qwen3-30B-A3B layer (d 2048, n 768, E 128, k 8, T 16384) in bf16; ``--tiny`` shrinks both and
runs every other case (the CPU dry run). Each row has the gap in bytes and relative to the
measured peak, and whether it is within the CUDA tolerance the gpu tests assert (``CUDA_PEAK_RTOL``,
``CUDA_PEAK_ATOL_BYTES`` in tests/tolerances.py): the file a first GPU run writes is the
measurement that tolerance is set from. Writes OUT_CSV (one row per case) and appends one row
per case to SUMMARY_CSV (rows of scripts/gpu_check.py's summary, no header).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from memfine.baselines.layers import half_rows_budget, layer_inputs, layer_method
from memfine.bench.harness import run_methods
from memfine.bench.options import LayerShape
from memfine.config import ChunkConfig
from memfine.nn import MoELayer
from memfine.suites.experts import moe_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tolerances import CUDA_PEAK_ATOL_BYTES, CUDA_PEAK_RTOL  # noqa: E402

COLUMNS = ["case", "device", "dtype", "tokens", "hidden_size", "intermediate_size",
           "num_experts", "top_k", "num_chunks", "recompute", "budget_bytes",
           "measured_peak_bytes", "predicted_peak_bytes", "gap_bytes", "gap_over_measured",
           "within_cuda_tolerance", "measured_saved_bytes", "predicted_saved_bytes",
           "profiler_peak_bytes", "error"]
TEST_SHAPE = LayerShape(name="gpu_test", tokens=4096, hidden_size=512, intermediate_size=384,
                        num_experts=16, top_k=4)
QWEN3 = LayerShape(name="qwen3-30b-a3b", tokens=16384, hidden_size=2048, intermediate_size=768,
                   num_experts=128, top_k=8)
TINY = {"gpu_test": LayerShape(name="gpu_test", tokens=256, hidden_size=64, intermediate_size=32,
                               num_experts=8, top_k=2),
        "qwen3-30b-a3b": LayerShape(name="qwen3-30b-a3b", tokens=512, hidden_size=64,
                                    intermediate_size=32, num_experts=16, top_k=4)}
# (shape, dtype, chunk config or "mact" for the half-rows budget)
CASES: list[tuple[LayerShape, torch.dtype, ChunkConfig | str]] = [
    (TEST_SHAPE, torch.bfloat16, ChunkConfig()),
    (TEST_SHAPE, torch.bfloat16, ChunkConfig(num_chunks=4, recompute="experts")),
    (TEST_SHAPE, torch.float32, ChunkConfig()),
    (QWEN3, torch.bfloat16, ChunkConfig()),
    (QWEN3, torch.bfloat16, ChunkConfig(num_chunks=4, recompute="experts")),
    (QWEN3, torch.bfloat16, ChunkConfig(num_chunks=8, recompute="full")),
    (QWEN3, torch.bfloat16, "mact"),
]


def _case(shape: LayerShape, dtype: torch.dtype, chunk: ChunkConfig | str,
          device: torch.device) -> dict[str, object]:
    moe = moe_config(shape)
    x_TD, grad_TD = layer_inputs(shape, dtype=dtype, device=device, seed=0)
    budget = None
    if chunk == "mact":
        budget = half_rows_budget(moe, shape.tokens, dtype.itemsize, device.type)
        chunk = ChunkConfig(memory_budget_bytes=budget, recompute="experts")
    assert isinstance(chunk, ChunkConfig)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds, not minutes, at Qwen3 size
        layer = MoELayer(moe, chunk=chunk).to(device=device, dtype=dtype)
    name = f"{shape.name}/{str(dtype).removeprefix('torch.')}/" + (
        "mact" if budget else f"c{chunk.num_chunks}-{chunk.resolved_recompute}")
    method = layer_method(name, layer, x_TD, grad_TD, budget_bytes=budget)
    (res,) = run_methods([method], repeats=1, warmup=1, device=device)
    row: dict[str, object] = {
        "case": name, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "tokens": shape.tokens, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_experts": shape.num_experts,
        "top_k": shape.top_k, "num_chunks": res.extras.get("num_chunks", ("", ""))[0],
        "recompute": chunk.resolved_recompute, "budget_bytes": budget or "",
        "error": res.error or ""}
    if res.memory is None:
        return row
    measured, predicted = res.memory.peak_bytes, res.predicted["peak_bytes"]
    row.update(measured_peak_bytes=measured, predicted_peak_bytes=predicted,
               measured_saved_bytes=res.memory.saved_bytes,
               predicted_saved_bytes=res.predicted["saved_bytes"],
               profiler_peak_bytes=res.extras.get("profiler_peak_bytes", ("", ""))[0])
    if measured and predicted is not None:
        gap = predicted - measured
        row.update(gap_bytes=gap, gap_over_measured=f"{gap / measured:.4f}",
                   within_cuda_tolerance=abs(gap) <= max(CUDA_PEAK_RTOL * measured,
                                                         CUDA_PEAK_ATOL_BYTES))
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_csv", type=Path)
    parser.add_argument("summary_csv", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="small shapes, every other case (the CPU dry run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    with args.out_csv.open("w", newline="") as f:  # row by row: a stopped run keeps its cases
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for shape, dtype, chunk in CASES[::2] if args.tiny else CASES:
            rows.append(_case(TINY[shape.name] if args.tiny else shape, dtype, chunk, device))
            writer.writerow(rows[-1])
            f.flush()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    tolerance = f"tolerance max({CUDA_PEAK_RTOL:g}·measured, {CUDA_PEAK_ATOL_BYTES} B)"
    with args.summary_csv.open("a", newline="") as f:
        for row in rows:
            status = ("failed" if row["error"] else "ok" if row.get("within_cuda_tolerance")
                      else "outside_tolerance")
            csv.writer(f).writerow(["peak", row["case"], status, "peak_gap_over_measured",
                                    row.get("gap_over_measured", ""), "ratio",
                                    f"measured {row.get('measured_peak_bytes', '')} B, predicted "
                                    f"{row.get('predicted_peak_bytes', '')} B; {tolerance}; "
                                    f"{args.out_csv.name}"])
    for row in rows:
        print(row["case"], row.get("measured_peak_bytes"), row.get("predicted_peak_bytes"),
              row.get("gap_over_measured"), row["error"])
    print(f"wrote {args.out_csv}")
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
