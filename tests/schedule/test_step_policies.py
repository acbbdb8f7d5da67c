"""A step plan's layers re-decide c from the rows they receive (s″ beyond T·k under EP).

On one process s″ ≤ T·k; the expert-parallel case is fed here as a skewed s″ and a transport
row width, as the expert-parallel experts pass them to the policy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.memory.step import StepPlanner
from memfine.nn import MoETransformerLM
from memfine.schedule import InfeasibleBudgetError
from memfine.schedule.step import step_layer_policies

TINY = ModelConfig(num_layers=3, num_heads=2, max_seq_len=16,
                   moe=MoEConfig(hidden_size=32, intermediate_size=32, num_experts=4, top_k=2))
B, Q, DT = 4, 16, 4
T = B * Q


def _plan_and_budget() -> tuple[StepPlanner, int]:
    planner = StepPlanner(TINY, B, Q, DT)
    low = planner.smallest_feasible_budget()
    return planner, (2 * low + planner.peak(planner.plan(10**12).choices)) // 3  # type: ignore[union-attr]


@pytest.mark.parametrize("transport", [0, 32])
def test_layers_run_the_plan_until_they_receive_more_rows(transport: int) -> None:
    planner, budget = _plan_and_budget()
    plan = planner.plan(budget)
    assert plan is not None
    policies = step_layer_policies(TINY, plan, budget, T, DT, [transport] * 3)
    slack = budget - plan.predicted_peak_bytes
    rows = T * TINY.moe.top_k
    for choice, policy in zip(plan.choices, policies, strict=True):
        for recv in (0, rows // 2, rows):  # the plan's own assumption and fewer rows
            decision = policy.decide(recv, T, DT, transport_row_elements=transport)
            assert (decision.num_chunks, decision.recompute) == (choice.num_chunks,
                                                                 choice.recompute)
        share = policy.config.memory_budget_bytes
        assert share is not None
        own = share - slack
        # skewed: rows beyond T·k raise the prediction; c rises to the first bin that fits
        skewed = next((r for r in range(rows, 64 * rows, rows // 4)
                       if policy.predicted_peak(r, T, DT, choice.num_chunks,
                                                transport_row_elements=transport) > share),
                      None)
        assert skewed is not None and own <= share
        decision = policy.decide(skewed, T, DT, transport_row_elements=transport)
        assert decision.num_chunks > choice.num_chunks
        assert decision.predicted_peak_bytes <= share
        assert decision.num_chunks == min(
            c for c in policy.config.bins
            if policy.predicted_peak(skewed, T, DT, c, transport_row_elements=transport)
            <= share)
        with pytest.raises(InfeasibleBudgetError):  # far more rows than any bin holds
            policy.decide(10**6, T, DT, transport_row_elements=transport)


def test_the_model_uses_re_deciding_layers_when_its_experts_receive_rows() -> None:
    """Experts with a transport (as under EP) get the re-deciding policies; with s″ = T·k each
    layer runs the plan's c and recompute mode. Local experts keep the fixed counts."""
    planner, budget = _plan_and_budget()
    config = dataclasses.replace(TINY, chunk=ChunkConfig(memory_budget_bytes=budget,
                                                         budget_scope="step"))
    model = MoETransformerLM(config)
    ids = torch.randint(0, 256, (B, Q))
    model(ids, ids)
    assert all(not block.moe.policy.budgeted for block in model.blocks)  # type: ignore[union-attr]
    for block in model.blocks:
        block.moe.experts.transport_row_elements = 32  # type: ignore[union-attr]
    out = model(ids, ids)
    plan = planner.plan(budget)
    assert plan is not None and model.last_plan == plan
    assert all(block.moe.policy.budgeted for block in model.blocks)  # type: ignore[union-attr]
    assert [(a.num_chunks, a.recompute) for a in out.aux] == [
        (c.num_chunks, c.recompute) for c in plan.choices]


def test_lengths_are_checked() -> None:
    planner, budget = _plan_and_budget()
    plan = planner.plan(budget)
    assert plan is not None
    with pytest.raises(ValueError, match="one entry per layer"):
        step_layer_policies(TINY, plan, budget, T, DT, [0])
