"""A batch's step plan, and its layers as chunk policies that re-decide c from received rows.

The step plan (:func:`plan_step`, :class:`memfine.memory.step.StepPlanner`) chooses every
layer's recompute mode and chunk count from T·k rows per layer. Under expert parallelism a rank
may receive more rows (s″ > T·k), and the plan alone would not see them.
:func:`step_layer_policies` turns the plan into one budgeted :class:`ChunkPolicy` per layer
(MACT inside the plan, MemFine §4.2):

- the layer's share of the step budget is its own predicted peak at the plan's c with s″ = T·k
  rows (and the transport's rows) plus the plan's slack, the step budget minus the plan's
  predicted step peak: the rest of the step is as the plan predicts, so the layer's own peak
  may grow by the slack and the step still fits;
- the bins start at the plan's c: with s″ ≤ T·k every call runs the plan's c (its prediction is
  the share's first term), and a call that receives more rows raises c to the smallest bin whose
  predicted peak with those rows fits the share, agreed over the expert-parallel group as in the
  layer scope; a call no bin fits raises :class:`InfeasibleBudgetError` (or, with
  ``allow_over_budget``, runs the largest bin).

Limits: under no recompute the rows beyond T·k also grow what the layer keeps for backward (its
H), which the later layers' shares do not see; under chunked or full recompute a layer keeps
only its input and the routing, whatever s″.

Reference: MemFine (arXiv 2511.21431) §4.2 (MACT per step and layer), Eq. 8-9.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from memfine.config import ChunkConfig, ModelConfig
from memfine.memory.step import StepPlan, step_planner
from memfine.schedule.decision import InfeasibleBudgetError
from memfine.schedule.policy import ChunkPolicy


def plan_step(config: ModelConfig, batch: int, seq: int, dtype_bytes: int,
              device_type: str = "cpu") -> StepPlan:
    """The step-scope plan of a (B, Q) batch under ``config.chunk``'s budget (MemFine §4).

    The least recomputation whose predicted step peak fits the budget
    (:class:`memfine.memory.step.StepPlanner`); with ``allow_over_budget`` and no such plan,
    the least-memory plan with a warning.

    Raises:
        ValueError: without ``ChunkConfig.memory_budget_bytes``.
        InfeasibleBudgetError: when no plan's predicted step peak fits the budget and
            ``allow_over_budget`` is False (names the ChunkConfig fields and the smallest
            feasible budget).
    """
    chunk = config.chunk
    budget = chunk.memory_budget_bytes
    if budget is None:
        raise ValueError("plan_step needs ChunkConfig.memory_budget_bytes")
    planner = step_planner(config, batch, seq, dtype_bytes, device_type)
    plan = planner.plan(budget)
    if plan is None:
        least = planner.least_memory_plan()
        err = InfeasibleBudgetError(
            budget, least.predicted_peak_bytes, chunk.bins,
            f"the whole step (B={batch} x Q={seq} tokens, budget_scope 'step') peaks at "
            f"{least.predicted_peak_bytes} bytes with its least-memory plan")
        if not chunk.allow_over_budget:
            raise err
        warnings.warn(f"{err}; running the least-memory plan (allow_over_budget)",
                      UserWarning, stacklevel=3)
        plan = least
    return plan


def step_layer_policies(config: ModelConfig, plan: StepPlan, budget_bytes: int,
                        num_tokens: int, dtype_bytes: int,
                        transport_row_elements: Sequence[int], device_type: str = "cpu"
                        ) -> list[ChunkPolicy]:
    """One budgeted policy per layer of ``plan`` that re-decides c from each call's s″.

    Args:
        config: the model (its ``chunk.bins`` and ``chunk.allow_over_budget``).
        plan: the step plan (one :class:`memfine.memory.step_timeline.LayerChoice` per layer).
        budget_bytes: the step budget, bytes.
        num_tokens: T, tokens entering each MoE layer on this rank.
        dtype_bytes: D_t.
        transport_row_elements: per layer, the experts' transport elements per received row
            (d under expert parallelism, 0 on one process).
        device_type: the activations' device type (the row blocks the plan's peaks assume: the
            device default of a config left at ``backward_block_bytes=None``, which the layer
            policies may then shrink for rows beyond T·k).

    Returns:
        Policies in layer order; each runs the plan's c while s″ ≤ T·k.

    Raises:
        ValueError: if the lengths of ``plan.choices`` and ``transport_row_elements`` differ
            from the number of layers.
    """
    L = config.num_layers
    if len(plan.choices) != L or len(transport_row_elements) != L:
        raise ValueError(f"plan.choices and transport_row_elements must hold one entry per "
                         f"layer ({L}), got {len(plan.choices)} and "
                         f"{len(transport_row_elements)}")
    slack = max(0, budget_bytes - plan.predicted_peak_bytes)
    rows = num_tokens * config.moe.top_k
    policies = []
    for choice, transport in zip(plan.choices, transport_row_elements, strict=True):
        own = ChunkPolicy(ChunkConfig(num_chunks=choice.num_chunks, recompute=choice.recompute),
                          config.moe).predicted_peak(rows, num_tokens, dtype_bytes,
                                                     choice.num_chunks,
                                                     transport_row_elements=transport,
                                                     device_type=device_type)
        bins = tuple(b for b in config.chunk.bins if b >= choice.num_chunks)
        policies.append(ChunkPolicy(ChunkConfig(
            memory_budget_bytes=own + slack, bins=bins, recompute=choice.recompute,
            allow_over_budget=config.chunk.allow_over_budget), config.moe))
    return policies
