"""The evidence that decides the expert path's design, one MoE layer at a time, row by row.

    gpu_check_evidence.py CSV [--methods fused fused_512mib ...] [--dry-run]

At the Qwen3-30B-A3B layer (d 2048, n 768, E 128, k 8) in bf16 at T 4096, then T 16384
(``--dry-run``: d 32, n 16, E 4, k 2 at T 128 and 256 on the CPU), methods on one set of weights,
one input and one incoming gradient:

- ``fused``: memfine's fused layer, the device's default backward row blocks;
- ``fused_512mib``: the same with 512 MiB row blocks (the default of a small device and a
  budget's smaller blocks; on an H200 the default runs these points in one block, so a fast
  ``fused`` next to a slow ``fused_512mib`` is the small blocks' cost);
- ``triton``: the fused layer on the Triton backend (``gemm_backend="triton"``; the interpreter
  on the CPU, where ``TRITON_INTERPRET=1`` must be set before the first launch);
- ``torchtitan_style``: torchtitan's expert recipe behind memfine's router
  (:mod:`memfine.baselines.titan_style`);
- ``hf_grouped_mm``: transformers' ``Qwen3MoeExperts`` with its ``grouped_mm`` experts (experts
  only, its own weights).

Per method, metrics (one CSV row each, appended and flushed as measured, so a kill keeps what was
measured): ``time_ms`` fwd + bwd, ``time_ms_fwd``, ``time_ms_bwd`` (median of ``repeats`` after
``warmup`` calls: CUDA events on a GPU, the harness's CPU clock otherwise); ``kernel_count`` and
``kernel_time_ms`` (CUDA kernels of one call in a ``torch.profiler`` trace, and their summed
device time), ``memcpy_memset_count``; ``cuda_host_syncs`` (warnings under
``torch.cuda.set_sync_debug_mode("warn")`` during one call); ``non_view_ops`` and
``host_syncs_counted`` (:class:`memfine.counts.OpCounter`, the counts suite's model of what a
GPU runs); ``peak_bytes`` against ``predicted_peak_bytes`` (the memory model; layer methods
only) and their ``peak_gap_over_measured``; ``max_abs_diff_vs_fused`` of the output. A CUDA-only
metric on the CPU is a row with status ``skipped: no CUDA (dry run)``; a method that cannot run
here (no triton, no transformers) is one ``skipped: <reason>`` row.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfine.baselines.layers import base_layer, layer_inputs, layer_method, sharing
from memfine.baselines.titan_style import titan_style_layer
from memfine.bench.harness import Method, run_methods
from memfine.bench.options import BenchOptions, LayerShape
from memfine.config import CUDA_BACKWARD_BLOCK_BYTES
from memfine.suites import counts, hf
from memfine.suites.experts import moe_config

COLUMNS = ["preset", "tokens", "method", "device", "dtype", "metric", "value", "unit", "status",
           "detail"]
METHODS = ("fused", "fused_512mib", "torchtitan_style", "hf_grouped_mm", "triton")
QWEN3 = LayerShape(name="qwen3-30b-a3b", tokens=4096, hidden_size=2048, intermediate_size=768,
                   num_experts=128, top_k=8)
TOKENS = (4096, 16384)
DRY = LayerShape(name="dry-run", tokens=128, hidden_size=32, intermediate_size=16,
                 num_experts=4, top_k=2)
DRY_TOKENS = (128, 256)
DTYPE = torch.bfloat16
NO_CUDA = "skipped: no CUDA (dry run)"


def _unavailable(name: str) -> str | None:
    """Why ``name`` cannot run here, or None."""
    if name == "hf_grouped_mm" and not hf.available():
        return "skipped: transformers not installed"
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "skipped: triton not installed"
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            return "skipped: no CUDA and TRITON_INTERPRET is not 1"
    return None


def build(shape: LayerShape, names: tuple[str, ...], device: torch.device,
          weights: dict[str, Any]) -> list[Method]:
    """The runnable methods of ``names`` at ``shape`` (bf16, shared weights and input).

    ``weights`` keeps the layer and the HF experts module across T (they do not depend on it);
    both are initialised on ``device`` (seconds, not minutes, at the Qwen3 layer's 0.6 B
    expert parameters).
    """
    moe = moe_config(shape)
    if "base" not in weights:
        with torch.device(device):
            weights["base"] = base_layer(moe, dtype=DTYPE, device=device, seed=0)
    base = weights["base"]
    x_TD, grad_TD = layer_inputs(shape, dtype=DTYPE, device=device, seed=0)
    small = dataclasses.replace(moe, backward_block_bytes=CUDA_BACKWARD_BLOCK_BYTES)
    makers: dict[str, Callable[[], Any]] = {
        "fused": lambda: sharing(base, moe),
        "fused_512mib": lambda: sharing(base, small),
        "triton": lambda: sharing(base, dataclasses.replace(moe, gemm_backend="triton")),
        "torchtitan_style": lambda: titan_style_layer(base, moe)}
    methods = []
    for name in names:
        if name in makers:
            methods.append(layer_method(name, makers[name](), x_TD, grad_TD,
                                        modelled=name != "torchtitan_style"))
        elif name == "hf_grouped_mm":
            opts = BenchOptions(suites=("hf",), dtype="bfloat16", seed=0)
            if "hf" not in weights:
                with torch.device(device):
                    weights["hf"] = hf.make_experts(shape, opts, device)
            methods += hf.build_methods(weights["hf"], hf.make_inputs(shape, opts, device),
                                        (name,))
    return methods


def _kernels(method: Method, device: torch.device) -> dict[str, tuple[float, str]]:
    """Kernel count, summed kernel time and copies of one call, from a CUDA profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    method.zero_grad()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        method.backward(method.forward())
        torch.cuda.synchronize(device)
    kernels = copies = 0
    kernel_us = 0.0
    for event in prof.events():
        if str(getattr(event, "device_type", "")).rsplit(".", 1)[-1] != "CUDA":
            continue
        if event.name.startswith(("Memcpy", "Memset")):
            copies += 1
            continue
        kernels += 1
        kernel_us += float(getattr(event, "device_time", 0.0) or 0.0)
    return {"kernel_count": (kernels, "kernels"), "kernel_time_ms": (kernel_us / 1e3, "ms"),
            "memcpy_memset_count": (copies, "ops")}


def _cuda_syncs(method: Method) -> int:
    """Synchronizing CUDA calls of one forward + backward (sync debug mode ``warn``)."""
    method.zero_grad()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            method.backward(method.forward())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _output(method: Method) -> torch.Tensor:
    method.zero_grad()
    res = method.forward()
    out = res[0] if isinstance(res, tuple) else res
    return out.detach().float()


class Rows:
    """Appends rows to the evidence CSV, flushed as each is written."""

    def __init__(self, path: Path, shape: LayerShape, device: torch.device) -> None:
        self.path, self.shape, self.device = path, shape, device
        if not path.exists() or path.stat().st_size == 0:
            self._write([COLUMNS])

    def _write(self, rows: list[list[object]]) -> None:
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerows(rows)
            f.flush()

    def add(self, method: str, metric: str, value: object, unit: str, status: str = "ok",
            detail: str = "") -> None:
        """One metric of ``method`` at this shape; printed too."""
        row = [self.shape.name, self.shape.tokens, method, self.device.type, "bfloat16", metric,
               f"{value:.6g}" if isinstance(value, float) else value, unit, status, detail]
        self._write([row])
        print(",".join(map(str, row)), flush=True)


def measure(method: Method, rows: Rows, *, repeats: int, warmup: int,
            fused_out: torch.Tensor | None) -> torch.Tensor | None:
    """Every metric of one method (module docstring); returns its output for the comparison."""
    name, cuda = method.name, rows.device.type == "cuda"
    (res,) = run_methods([method], repeats=repeats, warmup=warmup, device=rows.device)
    if res.error is not None:
        rows.add(name, "error", "", "", f"failed: {res.error[:200]}")
        return None
    for mode, metric in (("full", "time_ms"), ("fwd", "time_ms_fwd"), ("bwd", "time_ms_bwd")):
        p = res.time_ms(mode)
        rows.add(name, metric, "" if p is None else p[1], "ms", detail=f"median of {repeats} "
                 f"after {warmup} warm-up, {res.clock}")
    if cuda:
        for metric, (value, unit) in _kernels(method, rows.device).items():
            rows.add(name, metric, value, unit, detail="one fwd + bwd, torch.profiler")
        rows.add(name, "cuda_host_syncs", _cuda_syncs(method), "syncs",
                 detail="one fwd + bwd, torch.cuda.set_sync_debug_mode('warn')")
    else:
        for metric in ("kernel_count", "kernel_time_ms", "memcpy_memset_count",
                       "cuda_host_syncs"):
            rows.add(name, metric, "", "", NO_CUDA)
    counted = counts.count_method(method, warmup=False).phase("full")
    rows.add(name, "non_view_ops", counted.non_view_ops, "ops", detail="OpCounter, fwd + bwd")
    rows.add(name, "host_syncs_counted", counted.host_syncs, "syncs", detail="OpCounter")
    measured, predicted = res.peak_bytes, res.predicted.get("peak_bytes")
    rows.add(name, "peak_bytes", "" if measured is None else measured, "bytes",
             detail="torch.cuda.max_memory_allocated" if cuda else "live-storage tracker")
    if predicted is None:
        rows.add(name, "predicted_peak_bytes", "", "bytes", "skipped: not modelled")
    else:
        rows.add(name, "predicted_peak_bytes", predicted, "bytes", detail="memory model")
        if measured:
            rows.add(name, "peak_gap_over_measured", (predicted - measured) / measured, "ratio")
    out = _output(method)
    if name == "hf_grouped_mm":
        rows.add(name, "max_abs_diff_vs_fused", "", "", "skipped: experts only, own weights")
    elif fused_out is not None:
        rows.add(name, "max_abs_diff_vs_fused", float((out - fused_out).abs().max()), "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--tokens", type=int, nargs="+", help="T values (default: 4096 16384; "
                        "dry run 128 256)")
    parser.add_argument("--repeats", type=int, help="timed calls (default 5; dry run 2)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default 2; dry run 1)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    repeats, warmup = (2, 1) if args.dry_run else (5, 2)
    repeats = repeats if args.repeats is None else args.repeats
    warmup = warmup if args.warmup is None else args.warmup
    base, tokens = (DRY, DRY_TOKENS) if args.dry_run else (QWEN3, TOKENS)
    weights: dict[str, Any] = {}
    for T in args.tokens or tokens:
        shape = dataclasses.replace(base, tokens=T)
        rows = Rows(args.csv, shape, device)
        names = []
        for name in args.methods:
            reason = _unavailable(name)
            if reason is None:
                names.append(name)
            else:
                rows.add(name, "method", "", "", reason)
        fused_out = None
        for method in build(shape, tuple(names), device, weights):
            start = time.perf_counter()
            out = measure(method, rows, repeats=repeats, warmup=warmup, fused_out=fused_out)
            if method.name == "fused":
                fused_out = out
            rows.add(method.name, "wall_s", time.perf_counter() - start, "s")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
