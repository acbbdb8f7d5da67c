"""The Triton kernels' CUDA autotune configs compiled ahead of time on the CPU: shared memory.

Each config of :data:`memfine.triton_kernels.ops.GPU_CONFIGS` (BM = ``GPU_BLOCK_M``) is compiled
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` for sm_80 (A100) and
sm_90 (H100/H200), no GPU needed, for two kernels in bf16 at their Qwen3-30B-A3B use:

- ``grouped_gemm_down``: ``_grouped_gemm_kernel`` with the routing weight in the epilogue
  (GATHER off, SCALE on), the down-projection;
- ``gather_up_swiglu``: ``_gather_up_kernel`` gated (two accumulators, two weight tiles per K
  step), the up-projection with its gather.

The arguments are specialised as the runtime specialises aligned tensors (pointers and integer
arguments divisible by 16, unit strides constant 1), which is what lets the pipeliner turn the K
loop's loads into asynchronous copies. Per row: the compiled ``shared_bytes``
(``metadata.shared``, bytes), the ``num_stages`` asked for, ``async_copy`` (whether the K loop
was pipelined: ``ttg.async_copy`` in the TTGIR), ``cubin_bytes`` (0 when only PTX came out),
``fits`` (shared memory at most the architecture's per-block opt-in maximum: 166,912 bytes on
sm_80, 232,448 on sm_90; a config that does not fit is dropped by the autotuner at launch), the
compile time and the versions. Timing waits for a GPU: ``scripts/gpu_check.sh``'s
``evidence_triton`` part runs the autotuned kernels.

Usage: ``python benchmarks/triton_configs.py [--out benchmarks/results/triton_configs_aot.csv]
[--append]``. The committed table: triton 3.9.0 (the dev venv), then ``--append`` from a venv
with triton 3.6.0 (the GPU machine's image; scripts/ci_image_lane.sh's packages).
"""

from __future__ import annotations

import argparse
import csv
import inspect
import platform
import time
from pathlib import Path
from typing import Any

import torch

from memfine.triton_kernels import kernels
from memfine.triton_kernels.ops import GPU_BLOCK_M, GPU_CONFIGS

ARCHS = {"sm_80": (80, 166_912), "sm_90": (90, 232_448)}
"""Architecture → (compute capability, max shared memory per block in bytes, opt-in)."""
UNIT_STRIDES = ("stride_xi", "stride_wo", "stride_oo", "stride_hg", "stride_an")
KERNELS: dict[str, tuple[Any, dict[str, str], dict[str, int]]] = {
    "grouped_gemm_down": (kernels._grouped_gemm_kernel,
                          {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                           "rows_ptr": "*i32", "scale_ptr": "*bf16"},
                          {"GATHER": 0, "SCALE": 1}),
    "gather_up_swiglu": (kernels._gather_up_kernel,
                         {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16",
                          "rows_ptr": "*i32"},
                         {"GATED": 1, "ACT": 0}),
}
COLUMNS = ["kernel", "arch", "dtype", "BM", "BN", "BK", "num_warps", "num_stages",
           "shared_bytes", "async_copy", "cubin_bytes", "fits", "max_shared_bytes", "compile_s",
           "triton", "torch", "python"]


def compile_one(kernel: str, cc: int, config: dict[str, int]) -> Any:
    """Compile one kernel at one config for ``sm_<cc>``; the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, pointers, flags = KERNELS[kernel]
    params = list(inspect.signature(fn.fn).parameters)
    consts: dict[str, int] = {**flags, "UPCAST": 0, "IEEE": 0, "K_FIXED": 0, "BM": GPU_BLOCK_M,
                              "BN": config["BN"], "BK": config["BK"],
                              **{s: 1 for s in UNIT_STRIDES if s in params}}
    pointers = {**pointers, "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32",
                "offsets_ptr": "*i32"}
    signature = {p: pointers.get(p, "constexpr" if p in consts else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(params.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options={"num_warps": config["num_warps"],
                                   "num_stages": config["num_stages"]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/triton_configs_aot.csv"))
    parser.add_argument("--append", action="store_true",
                        help="add this triton's rows to --out (one table for several versions)")
    args = parser.parse_args()
    import triton

    rows = []
    for kernel in KERNELS:
        for arch, (cc, max_shared) in ARCHS.items():
            for config in GPU_CONFIGS:
                start = time.perf_counter()
                compiled = compile_one(kernel, cc, config)
                shared = int(compiled.metadata.shared)
                rows.append({
                    "kernel": kernel, "arch": arch, "dtype": "bfloat16", "BM": GPU_BLOCK_M,
                    **config, "shared_bytes": shared,
                    "async_copy": "async_copy" in compiled.asm["ttgir"],
                    "cubin_bytes": len(compiled.asm.get("cubin", b"")),
                    "fits": shared <= max_shared, "max_shared_bytes": max_shared,
                    "compile_s": f"{time.perf_counter() - start:.2f}",
                    "triton": triton.__version__, "torch": torch.__version__,
                    "python": platform.python_version()})
                print(",".join(str(v) for v in rows[-1].values()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    append = args.append and args.out.exists()
    with args.out.open("a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if not append:
            writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
