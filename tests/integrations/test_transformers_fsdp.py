"""A transformers MoE model on memfine experts under FSDP2 on 2 gloo ranks vs one process.

``fully_shard`` on every decoder layer and on the model (benchmarks/bench_hf_fsdp.py, which
these tests drive at a tiny shape), each rank on its half of the batch: the global loss of every
step equals the one-process eager run's (eager + PEFT for LoRA) within fp32 reassociation, full
fine-tune and PEFT LoRA on the experts; under ``register(memory_budget=...)`` each rank's MACT
counts its own tokens (its predicted experts-block peak equals the memory model's at the rank's
T, to the byte) and picks fewer chunks than one process with the whole batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_hf_fsdp import SHAPE, max_rel, train_rank  # noqa: E402
from ep_harness import check_outcome, run_scenarios, spawn  # noqa: E402

from memfine.config import MoEConfig  # noqa: E402
from memfine.config.lora import LoRAConfig  # noqa: E402
from memfine.memory.lora import lora_layer_memory  # noqa: E402

pytestmark = pytest.mark.distributed

TINY = {**SHAPE, "hidden_size": 32, "moe_intermediate_size": 32, "num_experts": 4, "top_k": 2,
        "vocab_size": 64, "batch_size": 4, "seq_len": 16, "rank": 4}
STEPS = 3
T_RANK = TINY["batch_size"] // 2 * TINY["seq_len"]  # tokens per experts call on one of 2 ranks


def _layer_peak(tokens: int, num_chunks: int) -> int:
    """The memory model's peak of one LoRA experts block (MACT's prediction)."""
    moe = MoEConfig(hidden_size=TINY["hidden_size"],
                    intermediate_size=TINY["moe_intermediate_size"],
                    num_experts=TINY["num_experts"], top_k=TINY["top_k"], renormalize=False,
                    activation="swiglu")
    lora = LoRAConfig(rank=TINY["rank"], alpha=2 * TINY["rank"], targets=("w_up", "w_down"),
                      train_router=True)
    return lora_layer_memory(moe, lora, tokens, 4, num_chunks=num_chunks,
                             recompute="experts").peak_bytes


BUDGET = _layer_peak(T_RANK, 1)  # one rank fits unchunked; the whole batch does not


def _ranks(rank: int, world: int) -> dict[str, Any]:
    def run(mode: str, budget: int | None = None) -> list[tuple[str, Any]]:
        # as (key, value) pairs: the harness reads a dict outcome as an error
        return list(train_rank(rank, world, TINY, "memfine", mode, STEPS, budget).items())

    return run_scenarios({"full": lambda: run("full"), "lora": lambda: run("lora"),
                          "lora_budget": lambda: run("lora", BUDGET)})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each scenario's result per rank."""
    per_rank = spawn(_ranks, 2, tmp_path_factory.mktemp("fsdp"))
    return {name: [dict(pairs) for pairs in check_outcome(per_rank, name)]
            for name in ("full", "lora", "lora_budget")}


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_fsdp2_losses_equal_one_eager_process(two_ranks: dict[str, list[dict[str, Any]]],
                                              mode: str) -> None:
    reference = train_rank(0, 1, TINY, "eager", mode, STEPS)["loss"]
    per_rank = two_ranks[mode]
    assert per_rank[0]["loss"] == per_rank[1]["loss"]  # all-reduced: one global loss
    assert max_rel(per_rank[0]["loss"], reference) <= 1e-5, (per_rank[0]["loss"], reference)
    assert len(set(reference)) == STEPS  # the steps train: the losses move
    assert all(r["peak_bytes"] > 0 for r in per_rank)


def test_fsdp2_budget_is_per_rank(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    one = train_rank(0, 1, TINY, "memfine", "lora", STEPS, BUDGET)
    reference = train_rank(0, 1, TINY, "eager", "lora", STEPS)["loss"]
    for result in two_ranks["lora_budget"]:
        assert result["num_chunks"] == [1] * 2  # both layers, on each rank
        assert result["predicted_peak_bytes"] == [_layer_peak(T_RANK, 1)] * 2
        assert max_rel(result["loss"], reference) <= 1e-5
    # one process has twice the tokens per call at the same budget: it must chunk
    assert min(one["num_chunks"]) > 1
    assert all(p <= BUDGET for p in one["predicted_peak_bytes"])
    assert max_rel(one["loss"], reference) <= 1e-5
