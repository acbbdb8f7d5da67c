"""torchtitan's own trainer, 3 steps: peak bytes and losses, torchtitan's experts vs memfine's.

Runs ``torchtitan.trainer.Trainer`` (built by torchtitan's ``ConfigManager`` from ``--module`` /
``--config``) on the CPU with gloo, at the test size of tests/integrations/torchtitan_trainer.py
(torchtitan's qwen3 ``debugmodel_moe`` with 2 layers and n = 128: d = 256, E = 64, k = 8;
fp32 parameters, no autocast; torchtitan's selective activation checkpointing; AdamW, lr 1e-4;
seed 0; local tokenizer and data) at batch 4 × 1024 tokens (T = 4096), methods:

- ``torchtitan``: torchtitan's ``qwen3_moe_debug`` config (its experts);
- ``memfine``: memfine's config function (``memfine.integrations.torchtitan_configs``), c = 1;
- ``memfine_c2``: the same with ``--override.imports ...memfine_experts={"num_chunks": 2}``;
- ``memfine_budget``: with a memory budget under which MACT picks c = 4 per block.

Metrics (CSV, docs/style.md §6 columns): ``peak_bytes`` of the whole training loop (3 steps:
forward, backward, optimizer step; ``torch.profiler(profile_memory=True)`` allocator events,
above the bytes alive before the loop: parameters and the model are built before it, the
optimizer state is allocated inside it), ``loss_step<i>`` (nats/token), and for memfine
``num_chunks`` (c of every block in the last step) and the first-step memory report of a block
from memfine's exact memory model (``fixed_bytes``: the predicted peak at T = 0;
``token_bytes``: the peak at c = 1 above it; ``smallest_feasible_budget_bytes``;
``predicted_peak_c<c>_bytes`` for every bin c). The budget of ``memfine_budget`` is the exact
predicted peak at c = 4. Each method runs in one fresh process.

Usage: ``python benchmarks/bench_torchtitan_trainer.py [--out PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "integrations"))

from torchtitan_trainer import (  # noqa: E402
    SMALL_DIM,
    SMALL_EXPERTS,
    SMALL_HIDDEN,
    SMALL_LAYERS,
    SMALL_LR,
    SMALL_TOP_K,
    budget_for_chunks,
    run_in_subprocess,
    small_runs,
)

from memfine.bench.results import csv_row, write_csv  # noqa: E402
from memfine.environment import collect_environment  # noqa: E402
from memfine.units import format_bytes  # noqa: E402

BENCHMARK = "torchtitan_trainer"
RESULTS = Path(__file__).parent / "results"
STEPS = 3


SHAPES = ((4, 1024),)  # (batch, seq_len): T = 4096 tokens


def bench_shape(batch: int, seq_len: int, env: object) -> list[dict[str, str]]:
    """Every method at one (batch, seq_len), each in its own process; CSV rows."""
    tokens = batch * seq_len
    budget = budget_for_chunks(4, tokens)
    methods = {"torchtitan": None, "memfine": None, "memfine_c2": '{"num_chunks": 2}',
               "memfine_budget": f'{{"memory_budget": {budget}}}'}
    config = {"model": "qwen3 debugmodel_moe", "layers": SMALL_LAYERS, "dim": SMALL_DIM,
              "hidden": SMALL_HIDDEN, "num_experts": SMALL_EXPERTS, "top_k": SMALL_TOP_K,
              "batch": batch, "seq_len": seq_len, "lr": SMALL_LR, "steps": STEPS,
              "dtype": "float32", "budget_bytes": budget,
              "torchtitan_version": version("torchtitan")}
    rows = []
    for name, options in methods.items():
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            result = run_in_subprocess(small_runs(work, {name: options}, steps=STEPS,
                                                  profile=True, batch=batch, seq_len=seq_len),
                                       work, timeout_s=3600)[name]
        chunks = sorted({d["num_chunks"] for d in result["decisions"].values()})
        print(f"T={tokens:5d} {name:15s} peak {format_bytes(result['peak_bytes'])}  losses "
              f"{', '.join(f'{x:.6f}' for x in result['losses'])}  c {chunks or '-'}",
              flush=True)

        def row(metric: str, unit: str, value: float | int | None, method: str = name) -> dict:
            return csv_row(benchmark=BENCHMARK, method=method, mode="full", metric=metric,
                           unit=unit, x_name="tokens", x_value=tokens, values=value,
                           config=config, env=env)

        rows.append(row("peak_bytes", "bytes", result["peak_bytes"]))
        rows += [row(f"loss_step{i}", "nats/token", loss)
                 for i, loss in enumerate(result["losses"], 1)]
        if chunks:
            rows.append(row("num_chunks", "count", max(chunks)))
            first = next(iter(result["budgets"].values()))  # every block has the same sizes
            rows += [row(key, "bytes", first[key]) for key in
                     ("fixed_bytes", "token_bytes", "smallest_feasible_budget_bytes")]
            rows += [row(f"predicted_peak_c{c}_bytes", "bytes", peak)
                     for c, peak in zip(first["bins"], first["bin_peak_bytes"], strict=True)]
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every method and shape; print peaks and losses; write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "torchtitan_trainer_cpu.csv")
    args = parser.parse_args(argv)
    env = collect_environment("cpu")
    rows = [row for batch, seq_len in SHAPES for row in bench_shape(batch, seq_len, env)]
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
