"""examples/trl_sft.py: TRL's SFTTrainer with PEFT LoRA on the experts, memfine vs eager.

A four-step run of the example's ``main`` on a tiny GPT-OSS model (biases, clamped SwiGLU):
from the same weights, adapters and batches, under TRL's defaults (gradient
checkpointing), the loss of every step and the adapters' gradients of step 1 equal eager +
PEFT's, and the CSV holds every metric.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

for _package in ("transformers", "accelerate", "peft", "datasets", "trl"):
    pytest.importorskip(_package, reason=f"{_package} is not installed: pip install -e '.[trl]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_sft.py"


def _example() -> Any:
    """examples/trl_sft.py loaded as a module."""
    spec = importlib.util.spec_from_file_location("trl_sft", EXAMPLE)
    assert spec is not None and spec.loader is not None, "examples/trl_sft.py is missing"
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_sft_trainer_with_peft_equals_eager(tmp_path: Path) -> None:
    example = _example()
    out = tmp_path / "trl_sft.csv"
    threads = torch.get_num_threads()
    try:
        assert example.main([
            "--models", "gpt_oss", "--steps", "4", "--batch-size", "2",
            "--seq-len", "32", "--hidden-size", "32", "--moe-intermediate-size", "32",
            "--num-experts", "4", "--top-k", "2", "--rank", "4", "--csv", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    with out.open() as f:
        rows = {(r["x_value"], r["method"], r["metric"]): float(r["p50"])
                for r in csv.DictReader(f)}
    assert rows["gpt_oss", "memfine", "loss_max_rel_diff"] <= 1e-5
    # fp32 reassociation only: the split adapters' gradients vs PEFT's dense W + ΔW
    assert rows["gpt_oss", "memfine", "grad_max_rel_diff"] <= 1e-4
    for impl in ("eager", "memfine"):
        assert rows["gpt_oss", impl, "peak_bytes"] > 0 and rows["gpt_oss", impl, "time"] > 0
