"""The CUDA autotune configs against their ahead-of-time compiled table (no GPU needed).

benchmarks/results/triton_configs_aot.csv (benchmarks/triton_configs.py) must list every config
of ``GPU_CONFIGS`` for both kernels and both architectures, per triton version it was made
with, each pipelined over K: at least ``num_stages - 1`` tiles of A and B (two B tiles for the
gated gather-up) in shared memory, within the architecture's limit. One config is recompiled
here for sm_90 and must give the table's shared memory.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

import timeouts

pytest.importorskip("triton", reason="needs triton (pip install 'memfine[triton]')")
from memfine.triton_kernels.ops import GPU_BLOCK_M, GPU_CONFIGS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "benchmarks" / "results" / "triton_configs_aot.csv"
KEY = ("BN", "BK", "num_warps", "num_stages")


def _rows() -> list[dict[str, str]]:
    with TABLE.open(newline="") as f:
        return list(csv.DictReader(f))


def test_table_covers_every_config_pipelined_within_shared_memory() -> None:
    rows = _rows()
    configs = {tuple(c[k] for k in KEY) for c in GPU_CONFIGS}
    for version in {r["triton"] for r in rows}:
        for kernel in ("grouped_gemm_down", "gather_up_swiglu"):
            for arch in ("sm_80", "sm_90"):
                got = {tuple(int(r[k]) for k in KEY) for r in rows if (
                    r["triton"], r["kernel"], r["arch"]) == (version, kernel, arch)}
                assert got == configs, (version, kernel, arch)
    for r in rows:
        bm, bn, bk, stages = GPU_BLOCK_M, int(r["BN"]), int(r["BK"]), int(r["num_stages"])
        b_tiles = 2 if r["kernel"] == "gather_up_swiglu" else 1
        stage_bytes = (bm * bk + b_tiles * bk * bn) * 2  # bf16
        assert int(r["BM"]) == bm and r["async_copy"] == "True", r
        assert int(r["shared_bytes"]) >= (stages - 1) * stage_bytes, r
        assert r["fits"] == "True" and int(r["shared_bytes"]) <= int(r["max_shared_bytes"]), r


def test_one_config_recompiles_to_the_table() -> None:
    import triton

    rows = [r for r in _rows() if r["triton"] == triton.__version__ and r["arch"] == "sm_90"
            and r["kernel"] == "grouped_gemm_down"]
    if not rows:
        pytest.skip(f"the table has no rows for triton {triton.__version__}")
    config = GPU_CONFIGS[0]
    (row,) = [r for r in rows if tuple(int(r[k]) for k in KEY) == tuple(config[k] for k in KEY)]
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import triton_configs as t; from "
            "memfine.triton_kernels.ops import GPU_CONFIGS as C; "
            "print(t.compile_one('grouped_gemm_down', 90, C[0]).metadata.shared)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = timeouts.run([sys.executable, "-c", code], 300, capture_output=True, env=env,
                        cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == int(row["shared_bytes"])
