"""``memfine train --lora-rank 8`` on 2 ranks under torchrun against one process, and resumed.

Trains a 3-step ``tiny`` base run, then LoRA fine-tunes (r 8, α 16) on it for ``--steps`` steps:
once on one process (the reference), at (dp_shard, ep) = (2, 1) and (1, 2) under
``torchrun --nproc_per_node 2`` (gloo, CPU), and as a chain whose first half runs on 2 ranks at
(1, 2) and whose second half resumes the adapter-only DCP checkpoint on one process. Writes, per
method, the largest per-step difference of the training loss from the reference (absolute,
nats/byte, and relative), of the gradient norm (relative), and the largest absolute difference
of any parameter of the final model (the frozen base read from the base run, adapters from the
checkpoint).

    python benchmarks/bench_lora_ranks.py --out benchmarks/results/lora_ranks_cpu.csv
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from memfine.bench.results import collect_environment, csv_row, write_csv
from memfine.inference.trained import load_trained

COMMON = ["train", "--sample-tokens", "0", "--no-progress", "--threads", "1",
          "--lr-decay-steps", "20"]
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--warmup-steps", "1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(out: Path, layout: tuple[int, int], *args: str) -> None:
    dp_shard, ep = layout
    cmd = [sys.executable, "-m", "memfine"]
    if dp_shard * ep > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(dp_shard * ep), "--master_addr", "127.0.0.1", "--master_port", str(_port()),
               "-m", "memfine"]
        args = (*args, "--dp-shard", str(dp_shard), "--ep", str(ep))
    preset = [] if "--resume" in args else ["--preset", "tiny"]
    subprocess.run([*cmd, *COMMON, *preset, *args, "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _metric(run: Path, key: str) -> torch.Tensor:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return torch.tensor([json.loads(line)[key] for line in lines], dtype=torch.float64)


def _differences(run: Path, ref: Path) -> dict[str, tuple[float, str]]:
    loss, ref_loss = _metric(run, "train_loss"), _metric(ref, "train_loss")
    norm, ref_norm = _metric(run, "grad_norm"), _metric(ref, "grad_norm")
    params, ref_params = (load_trained(r).model.state_dict() for r in (run, ref))
    return {
        "steps": (float(len(loss)), "steps"),
        "max_abs_loss_diff": (float((loss - ref_loss).abs().max()), "nats/byte"),
        "max_rel_loss_diff": (float(((loss - ref_loss).abs() / ref_loss.abs()).max()), "ratio"),
        "max_rel_grad_norm_diff": (float(((norm - ref_norm).abs() / ref_norm.abs()).max()),
                                   "ratio"),
        "max_abs_param_diff": (max(float((v.double() - ref_params[k].double()).abs().max())
                                   for k, v in params.items()), "value"),
    }


def main() -> None:
    """Run the base, the one-process reference and the 2-rank runs; write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/lora_ranks_cpu.csv")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    env = collect_environment("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, ref = root / "base", root / "one_process"
        _train(base, (1, 1), "--max-steps", "3")
        lora = [*LORA, "--init-from", str(base)]
        _train(ref, (1, 1), *lora, "--max-steps", str(args.steps))
        runs = {}
        for name, layout in (("dp2_ep1", (2, 1)), ("dp1_ep2", (1, 2))):
            runs[name] = root / name
            _train(runs[name], layout, *lora, "--max-steps", str(args.steps))
        chain = runs["dp1_ep2_then_one_process"] = root / "chain"
        _train(chain, (1, 2), *lora, "--max-steps", str(args.steps // 2))
        _train(chain, (1, 1), "--resume", "--max-steps", str(args.steps))
        config = {"preset": "tiny", "rank": 8, "alpha": 16, "dtype": "float32", "backend": "gloo",
                  "ranks": 2, "threads": 1, "reference": "one_process"}
        for name, run in runs.items():
            for metric, (value, unit) in _differences(run, ref).items():
                rows.append(csv_row(benchmark="lora_ranks", method=name, mode="full",
                                    metric=metric, unit=unit, x_name="layout", x_value=name,
                                    values=value, config=config, env=env))
    path = write_csv(rows, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
