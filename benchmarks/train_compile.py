"""``memfine train --compile`` against eager: per-step training losses and wall time (CPU).

Runs ``python -m memfine train --preset tiny --max-steps N`` twice, eager and with
``--compile`` (inductor, the compilation included in its time), into temporary run directories.
The tiny preset logs every step, and a logged step measures its peak under the live-storage
tracker, a ``TorchDispatchMode`` under which Dynamo does not compile: those steps would run
eagerly. Both runs therefore replace ``memfine.train.step.measured_peak`` with a context that
measures nothing (``peak_bytes`` is then not logged), so every step of the compiled run runs the
compiled graph. Writes benchmarks/results/train_compile_cpu.csv: one row per run and step with
the training loss (nats/byte), then the largest absolute loss difference (nats/byte), each run's
``wall_s`` (seconds, from its summary.json) and the machine's 1-minute load average at the start
and end.

    python benchmarks/train_compile.py [--max-steps 20]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import memfine

OUT = Path(__file__).parent / "results" / "train_compile_cpu.csv"
COLUMNS = ["benchmark", "provider", "metric", "unit", "step", "value", "torch", "memfine",
           "git_sha", "utc"]


# `python -m memfine ...` with the logged steps' peak measurement replaced by a no-op.
_UNMEASURED_RUN = """
import contextlib, runpy, sys
import memfine.train.step as step
step.measured_peak = lambda device, enabled: contextlib.nullcontext(None)
sys.argv = sys.argv[1:]
runpy.run_module("memfine", run_name="__main__")
"""


def _train(out: Path, max_steps: int, compile: bool) -> tuple[dict[int, float], float]:
    """Run one training; (step → train loss, wall seconds)."""
    argv = ["memfine", "train", "--preset", "tiny", "--max-steps", str(max_steps),
            "--no-progress", "--out", str(out), *(["--compile"] if compile else [])]
    subprocess.run([sys.executable, "-c", _UNMEASURED_RUN, *argv], check=True,
                   stdout=subprocess.DEVNULL)
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("train_loss") is not None:
            losses[int(record["step"])] = float(record["train_loss"])
    return losses, float(json.loads((out / "summary.json").read_text())["wall_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: _train(Path(tmp) / name, args.max_steps, name == "compiled")
                for name in ("eager", "compiled")}
    load_end = os.getloadavg()[0]
    eager, compiled = runs["eager"][0], runs["compiled"][0]
    if eager.keys() != compiled.keys():
        raise SystemExit(f"logged steps differ: {sorted(eager)} vs {sorted(compiled)}")
    diff = max(abs(eager[s] - compiled[s]) for s in eager)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=False).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tail = [torch.__version__, getattr(memfine, "__version__", ""), sha, stamp]
    rows = [["train_tiny", name, "train_loss", "nats/byte", step, f"{loss:.9g}", *tail]
            for name, (losses, _) in runs.items() for step, loss in sorted(losses.items())]
    rows += [["train_tiny", name, "wall_s", "s", "", f"{wall:.1f}", *tail]
             for name, (_, wall) in runs.items()]
    rows += [["train_tiny", "compiled", "max_abs_loss_diff", "nats/byte", "", f"{diff:.3g}",
              *tail],
             ["train_tiny", "machine", "load_average_1m_start", "processes", "",
              f"{load_start:.2f}", *tail],
             ["train_tiny", "machine", "load_average_1m_end", "processes", "", f"{load_end:.2f}",
              *tail]]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", newline="") as f:
        csv.writer(f).writerows([COLUMNS, *rows])
    print(f"max |loss eager - loss compiled| = {diff:.3g} nats/byte over {len(eager)} steps; "
          f"wall eager {runs['eager'][1]:.1f} s, compiled {runs['compiled'][1]:.1f} s; "
          f"load average {load_start:.2f} -> {load_end:.2f}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
