"""The whole-step memory model against torch.profiler, and the step plan under a budget.

Ground truth: :class:`memfine.measure.profiled.ProfiledPeakMemory` (torch.profiler allocator
events) around one training step of :class:`memfine.nn.MoETransformerLM` with one (recompute, c)
per layer; the model is :func:`memfine.memory.step_timeline.simulate_step`. The plan's choice is
checked against a brute force over every plan of the model (independent of the planner's search).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.measure.profiled import ProfiledPeakMemory
from memfine.memory.step import StepPlan, StepPlanner, recompute_flops
from memfine.memory.step_timeline import LayerChoice, simulate_step
from memfine.nn import MoETransformerLM
from memfine.schedule import InfeasibleBudgetError
from tolerances import STEP_PEAK_RTOL

SMALL = ModelConfig(num_layers=4, num_heads=4, max_seq_len=128,
                    moe=MoEConfig(hidden_size=128, intermediate_size=128, num_experts=8,
                                  top_k=2))  # the ``small`` preset's model, B 32 × Q 128
MID = ModelConfig(num_layers=4, num_heads=4, max_seq_len=128,
                  moe=MoEConfig(hidden_size=256, intermediate_size=512, num_experts=16,
                                top_k=4))
TINY = ModelConfig(num_layers=3, num_heads=2, max_seq_len=16,
                   moe=MoEConfig(hidden_size=32, intermediate_size=32, num_experts=4, top_k=2))


def _plan(text: str) -> tuple[LayerChoice, ...]:
    modes = {"n": "none", "e": "experts", "f": "full"}
    return tuple(LayerChoice(modes[x[0]], int(x[1:])) for x in text.split())


def _measured_step_peak(config: ModelConfig, batch: int, seq: int,
                        plan: tuple[LayerChoice, ...]) -> int:
    torch.manual_seed(0)
    model = MoETransformerLM(config)
    model.apply_plan(StepPlan(plan, 0, 0))
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    moe = config.moe
    with ProfiledPeakMemory() as prof:
        out = model(ids, ids)
        loss = out.loss + moe.aux_loss_coef * out.load_balancing_loss + moe.z_loss_coef * out.z_loss
        loss.backward()
        del out, loss
    return int(prof.peak_bytes)


CASES = [
    pytest.param(SMALL, 32, 128, "f1 e2 n1 n4", id="small-mix"),
    pytest.param(MID, 8, 128, "f2 e4 n1 e1", id="mid-mix"),
    pytest.param(MID, 4, 128, "n1 n1 n1 n1", id="mid-none-b4"),
    pytest.param(SMALL, 32, 128, "f1 f1 f1 f1", id="small-full", marks=pytest.mark.slow),
    pytest.param(SMALL, 32, 128, "n2 n2 n2 n2", id="small-none", marks=pytest.mark.slow),
    pytest.param(MID, 8, 128, "e8 e8 e8 e8", id="mid-experts", marks=pytest.mark.slow),
    pytest.param(MID, 8, 128, "n1 f4 n2 f1", id="mid-mix2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("config", "batch", "seq", "plan"), CASES)
def test_step_model_equals_the_profiler(config: ModelConfig, batch: int, seq: int,
                                        plan: str) -> None:
    choices = _plan(plan)
    measured = _measured_step_peak(config, batch, seq, choices)
    predicted = simulate_step(config, batch, seq, 4, choices).peak
    assert predicted == pytest.approx(measured, rel=STEP_PEAK_RTOL), (predicted, measured)


def _brute_force(planner: StepPlanner, budget: int) -> tuple[int, int] | None:
    """(least recompute FLOPs, then least total chunks) over every plan that fits."""
    options = [LayerChoice(m, c) for m in ("none", "experts", "full") for c in planner.bins]
    best = None
    for plan in itertools.product(options, repeat=planner.config.num_layers):
        if planner.peak(plan) <= budget:
            key = (sum(recompute_flops(planner.config, planner.batch, planner.seq, x.recompute)
                       for x in plan), sum(x.num_chunks for x in plan))
            best = key if best is None or key < best else best
    return best


def test_the_plan_fits_and_recomputes_least() -> None:
    config = dataclasses.replace(TINY, chunk=ChunkConfig(bins=(1, 2, 4)))
    planner = StepPlanner(config, 4, 16, 4)
    low, high = planner.smallest_feasible_budget(), planner.peak(_plan("n1 n1 n1"))
    assert low < high
    for budget in (low, (2 * low + high) // 3, (low + 2 * high) // 3, high):
        plan = planner.plan(budget)
        assert plan is not None and plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes == planner.peak(plan.choices)
        want = _brute_force(planner, budget)
        assert want is not None and want[0] == plan.recompute_flops
    assert planner.plan(low - 1) is None
    assert planner.plan(high).choices == _plan("n1 n1 n1")  # no recompute when it fits


def test_the_model_plans_per_token_count_and_refuses_an_infeasible_budget() -> None:
    planner = StepPlanner(TINY, 4, 16, 4)
    budget = (planner.smallest_feasible_budget() + planner.peak(_plan("n1 n1 n1"))) // 2
    config = dataclasses.replace(TINY, chunk=ChunkConfig(memory_budget_bytes=budget,
                                                         budget_scope="step"))
    model = MoETransformerLM(config)
    ids = torch.randint(0, 256, (4, 16))
    out = model(ids, ids)
    assert model.last_plan is not None and model.last_plan == planner.plan(budget)
    assert [a.recompute for a in out.aux] == [c.recompute for c in model.last_plan.choices]
    assert [a.num_chunks for a in out.aux] == [c.num_chunks for c in model.last_plan.choices]
    model(ids[:2], ids[:2])  # another T: planned again for it
    assert model.last_plan == StepPlanner(TINY, 2, 16, 4).plan(budget)
    tight = dataclasses.replace(TINY, chunk=ChunkConfig(memory_budget_bytes=1024,
                                                        budget_scope="step"))
    with pytest.raises(InfeasibleBudgetError, match=r"^ChunkConfig.memory_budget_bytes .* "
                       r"the smallest feasible budget is"):
        MoETransformerLM(tight)(ids, ids)


def test_plan_length_is_checked() -> None:
    with pytest.raises(ValueError, match="one LayerChoice per layer"):
        simulate_step(TINY, 2, 8, 4, _plan("n1"))


@pytest.mark.parametrize("plan", ["n1 n1 n1 n1", "f2 e4 n1 e1", "f8 f8 f8 f8", "f1 f1 f1 f1"])
def test_mid_model_step_is_exact_to_a_few_bytes(plan: str) -> None:
    """The mid model's step (B 4 × Q 128): the model is the profiler's peak to within one
    4-byte scalar per layer (a finished layer's output is freed by the residual sum; the router
    nodes hold views of the mean losses' (L,) gradients until the first block's node runs).
    With full block recompute at c = 8 the peak lies in the first block's RMSNorm backward,
    where the weight's multiply holds grad·(x·rstd) and grad·weight at once."""
    choices = _plan(plan)
    measured = _measured_step_peak(MID, 4, 128, choices)
    predicted = simulate_step(MID, 4, 128, 4, choices).peak
    assert abs(predicted - measured) <= 4 * MID.num_layers, (predicted, measured)
