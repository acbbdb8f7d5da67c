"""scripts/gpu_check_evidence.py on CUDA: every metric measured, none skipped, outputs agree.

At the Qwen3-30B-A3B layer's dims with T 512 (the script's shapes; T from ``--tokens``).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from devices import gpu

pytestmark = gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_evidence_rows_on_cuda(tmp_path: Path) -> None:
    import gpu_check_evidence

    out = tmp_path / "evidence.csv"
    assert gpu_check_evidence.main([str(out), "--tokens", "512", "--repeats", "2",
                                    "--warmup", "1"]) == 0
    with out.open(newline="") as f:
        rows = {(r["method"], r["metric"]): r for r in csv.DictReader(f)}
    methods = {m for m, _ in rows}
    assert {"fused", "fused_512mib", "torchtitan_style", "triton"} <= methods
    for method in methods - {"hf_grouped_mm"}:
        for metric in ("time_ms", "kernel_count", "kernel_time_ms", "cuda_host_syncs",
                       "non_view_ops", "peak_bytes"):
            row = rows[(method, metric)]
            assert row["status"] == "ok" and row["device"] == "cuda", row
        assert float(rows[(method, "kernel_count")]["value"]) > 0
        assert float(rows[(method, "kernel_time_ms")]["value"]) > 0
        assert int(rows[(method, "cuda_host_syncs")]["value"]) <= 4
        if method != "fused":  # bf16 outputs of the same layer: rounding apart, not more
            assert float(rows[(method, "max_abs_diff_vs_fused")]["value"]) < 0.05
    assert rows[("fused", "predicted_peak_bytes")]["status"] == "ok"
