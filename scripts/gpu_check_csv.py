"""Rows of scripts/gpu_check.sh's one CSV: part, name, status, metric, value, unit, detail.

    gpu_check_csv.py CSV part NAME STATUS SECONDS    a part's outcome and wall time
    gpu_check_csv.py CSV environment                  GPU name, torch, CUDA, triton versions,
                                                      torchtitan (or why its method is skipped)
    gpu_check_csv.py CSV junit FILE                   one row per test (passed/failed/skipped)
    gpu_check_csv.py CSV bench FILE...                the p50 time, peak and saved bytes per method
    gpu_check_csv.py CSV train NAME RUN_DIR           last loss, tokens/s, peak bytes of a run

Only the standard library, except ``environment`` (torch, memfine), so the install part can log
a row.
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COLUMNS = ["part", "name", "status", "metric", "value", "unit", "detail"]
BENCH_METRICS = ("time", "peak_bytes", "saved_bytes", "peak_bytes_predicted", "num_chunks")


def _append(path: Path, rows: list[list[object]]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(COLUMNS)
        writer.writerows(rows)


def _environment() -> list[list[object]]:
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else "none (cpu)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    from memfine.baselines.titan_style import torchtitan_missing

    missing = torchtitan_missing()
    if missing is not None:
        print(f"torchtitan: skipped (the layer benchmark's and equality's torchtitan rows): "
              f"{missing}")
    titan = ["environment", "torchtitan", "skipped" if missing else "ok", "version",
             "" if missing else _version("torchtitan"), "", missing or ""]
    return [["environment", "gpu", "ok", "device", gpu, "", ""], titan,
            ["environment", "torch", "ok", "version", torch.__version__, "",
             f"cuda {torch.version.cuda}"],
            ["environment", "triton", "ok", "version", triton_version, "", ""]]


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _junit(path: Path) -> list[list[object]]:
    if not path.exists():
        return [["gpu_tests", "junit", "missing", "", "", "", str(path)]]
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                status = "failed" if kind != "skipped" else "skipped"
                detail = (node.get("message") or "").splitlines()[0][:200] if node.get(
                    "message") else ""
        rows.append(["gpu_tests", f"{case.get('classname')}::{case.get('name')}", status,
                     "time", case.get("time", ""), "s", detail])
    return rows


def _bench(paths: list[str]) -> list[list[object]]:
    rows = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            rows.append(["layer_bench", path.name, "missing", "", "", "", ""])
            continue
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get("metric") in BENCH_METRICS and (row["metric"] != "time"
                                                           or row.get("mode") == "full"):
                    rows.append(["layer_bench", f"{row['benchmark']}/{row['method']}", "ok",
                                 row["metric"], row["p50"], row["unit"],
                                 f"{row['x_name']}={row['x_value']} device={row['device']}"])
    return rows


def _train(name: str, run_dir: Path) -> list[list[object]]:
    summary = run_dir / "summary.json"
    if not summary.exists():
        return [["train", name, "missing", "", "", "", str(summary)]]
    data = json.loads(summary.read_text())
    keep = {"final_val_loss_nats_per_byte": "nats/byte", "tokens_per_s": "tokens/s",
            "step": "steps", "wall_s": "s"}
    return [["train", name, "ok", key, data[key], unit, ""] for key, unit in keep.items()
            if key in data]


def main(argv: list[str]) -> int:
    path, command, *args = argv
    if command == "part":
        name, status, seconds = args
        rows: list[list[object]] = [[name, name, status, "wall_time", seconds, "s", ""]]
    elif command == "environment":
        rows = _environment()
    elif command == "junit":
        rows = _junit(Path(args[0]))
    elif command == "bench":
        rows = _bench(args)
    elif command == "train":
        rows = _train(args[0], Path(args[1]))
    else:
        print(f"gpu_check_csv.py: unknown command {command!r}", file=sys.stderr)
        return 2
    _append(Path(path), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
