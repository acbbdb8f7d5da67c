"""Rows of scripts/gpu_check.py's summary CSV: part, name, status, metric, value, unit, detail.

Standard library only (the runner imports it before anything is known about the python):
:func:`environment` from the runner's probe, :func:`junit` from pytest's XML, :func:`train`
from a run's ``summary.json``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

COLUMNS = ["part", "name", "status", "metric", "value", "unit", "detail"]
Row = list[object]


def environment(info: dict[str, object]) -> list[Row]:
    """The GPU, the versions, where memfine came from; torchtitan ``skipped`` with the reason."""
    rows: list[Row] = [["environment", "gpu", "ok", "device", info.get("gpu") or "none (cpu)",
                        "", ""],
                       ["environment", "python", "ok", "version", info.get("python", ""), "", ""],
                       ["environment", "torch", "ok" if info.get("torch") else "missing",
                        "version", info.get("torch") or "", "",
                        f"cuda {info.get('torch_cuda')}" if info.get("torch") else
                        str(info.get("error", ""))]]
    for name in ("triton", "transformers", "peft", "numpy"):
        version = info.get(name)
        rows.append(["environment", name, "ok" if version else "skipped: not installed",
                     "version", version or "", "", ""])
    memfine = info.get("memfine")
    rows.append(["environment", "memfine", "ok" if memfine else "failed", "source",
                 memfine or "", "", info.get("memfine_error", "")])
    missing = info.get("torchtitan_missing")
    if missing or not info.get("torchtitan"):
        reason = str(missing or "torchtitan is not installed")
        print(f"torchtitan: skipped: {reason}")
        rows.append(["environment", "torchtitan", f"skipped: {reason.splitlines()[0]}",
                     "version", "", "", reason])
    else:
        rows.append(["environment", "torchtitan", "ok", "version", info["torchtitan"], "", ""])
    return rows


def junit(path: Path) -> list[Row]:
    """One row per test case of pytest's JUnit XML (passed, failed or skipped: reason)."""
    if not path.exists():
        return [["gpu_tests", "junit", "missing", "", "", "", str(path.name)]]
    rows: list[Row] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or "").splitlines()
                detail = message[0][:200] if message else ""
                status = f"skipped: {detail}" if kind == "skipped" else "failed"
        rows.append(["gpu_tests", f"{case.get('classname')}::{case.get('name')}", status,
                     "time", case.get("time", ""), "s", detail])
    return rows


def train(name: str, run_dir: Path) -> list[Row]:
    """Last validation loss, tokens/s, steps and wall time of a ``memfine train`` run."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return [[name, "summary", "missing", "", "", "", "no summary.json"]]
    data = json.loads(summary.read_text())
    keep = {"final_val_loss_nats_per_byte": "nats/byte", "tokens_per_s": "tokens/s",
            "step": "steps", "wall_s": "s"}
    return [[name, "run", "ok", key, data[key], unit, ""] for key, unit in keep.items()
            if key in data]
