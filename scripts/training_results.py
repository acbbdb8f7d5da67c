"""Collect a finished ``memfine train`` run into the JSON docs/results.md's training table quotes.

Usage: ``python scripts/training_results.py RUN_DIR OUT_JSON`` (``make results`` runs the
``small`` preset into ``runs/results-small`` and then this script). The JSON holds the run's
config, ``summary.json`` (final validation loss, unigram baseline, tokens/s, wall time), the
validation loss at each evaluation step from ``metrics.jsonl``, the measured and predicted peak
bytes of the last logged step, and the environment (versions, CPU, git commit, UTC time,
load average).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

from memfine.environment import collect_environment
from memfine.reports.metrics import read_metrics


def collect(run_dir: Path) -> dict[str, object]:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    records = read_metrics(run_dir / "metrics.jsonl")
    last = records[-1]
    environment = dataclasses.asdict(collect_environment("cpu"))
    environment.pop("threads")  # this script's, not the run's (memfine train --threads, default 1)
    return {
        "command": "make results",
        "config": config,
        "summary": summary,
        "val_loss_by_step": {str(r["step"]): r["val_loss"] for r in records if "val_loss" in r},
        "last_logged_step": {key: last.get(key) for key in
                             ("step", "train_loss", "peak_bytes", "peak_bytes_predicted")},
        "environment": {
            **environment,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished memfine train run directory")
    parser.add_argument("out_json", type=Path, help="where to write the results JSON")
    args = parser.parse_args(argv)
    results = collect(args.run_dir)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out_json.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, args.out_json)
    print(f"wrote {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
