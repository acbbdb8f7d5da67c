"""``memfine train --memory-budget``: refuse a budget that no plan meets, in the flags' words.

Layer scope (``--budget-scope layer``): a MACT budget (MemFine Eq. 8-9) is met when some bin's
exact predicted layer peak fits it (:meth:`memfine.schedule.ChunkPolicy.smallest_feasible_budget`,
the same policy and numbers the layers use at run time). On one process a training step's MoE
layer sees T = B·Q tokens (``--batch-size`` × ``--seq-len``; evaluation batches are the same size
and sampling fewer) and receives at most s″ = T·k rows (fewer with a capacity factor:
:func:`memfine.routing.max_routed_rows`), so the budget either holds for every call or fails at
the first: the check refuses it before any file is written.

Step scope (``--budget-scope step``): the whole step's plan
(:class:`memfine.memory.step.StepPlanner`) must fit; its smallest feasible budget is the
least-memory plan's predicted step peak (checked under torchrun too: it depends on T only).

Under torchrun a rank's rows depend on the other ranks' routing: the layer scope is checked per
call at run time, worded by :mod:`memfine.schedule.wording`.
"""

from __future__ import annotations

from memfine.config import ChunkConfig, MoEConfig, TrainConfig
from memfine.memory.step import StepPlanner
from memfine.routing import max_routed_rows
from memfine.schedule.decision import ChunkPlan, InfeasibleBudgetError
from memfine.schedule.policy import ChunkPolicy, block_text
from memfine.schedule.wording import flag_message
from memfine.units import DTYPE_BYTES


def check_memory_budget(config: TrainConfig, world_size: int = 1) -> None:
    """Refuse a ``--memory-budget`` that no chunk count in ``--bins`` (no step plan) can meet.

    Nothing is checked without a budget, with ``--allow-over-budget`` (the run then uses the
    largest bin, or the least-memory plan, with a warning), or for the layer scope under torchrun.

    Args:
        config: the resolved run configuration.
        world_size: torchrun's ``WORLD_SIZE`` (1 on one process).

    Raises:
        ValueError: one line naming ``--memory-budget`` and ``--bins``, the value given, the
            smallest feasible budget for this model and batch, and what to change.

    Reference: MemFine Eq. 8-9 with MACT's bins (§4.2), with the exact memory model.
    """
    chunk, moe = config.model.chunk, config.model.moe
    budget = chunk.memory_budget_bytes
    if budget is None or chunk.allow_over_budget:
        return
    T = config.batch_size * config.seq_len
    dtype_bytes = DTYPE_BYTES[config.dtype]
    if chunk.budget_scope == "step":
        planner = StepPlanner(config.model, config.batch_size, config.seq_len, dtype_bytes,
                              config.device.split(":")[0])
        need = planner.smallest_feasible_budget()
        where = (f"the least-memory plan of the whole step (B={config.batch_size} x "
                 f"Q={config.seq_len}, {config.dtype})")
    else:
        if world_size > 1:
            return
        compute_bytes = DTYPE_BYTES[config.autocast] if config.autocast != "none" else dtype_bytes
        need, rows, least = layer_need(chunk, moe, T, compute_bytes,
                                       config.device.split(":")[0])
        where = (f"one MoE layer call (T={T} tokens = --batch-size {config.batch_size} x "
                 f"--seq-len {config.seq_len}, s''={rows} rows, {config.dtype}) at its best bin "
                 f"(c={least.num_chunks}, {block_text(least.block_rows)})")
    if budget >= need:
        return
    err = InfeasibleBudgetError(budget, need, chunk.bins, f"{where} needs more (or lower "
                                f"--batch-size or --seq-len)")
    raise ValueError(flag_message(err))


def layer_need(chunk: ChunkConfig, moe: MoEConfig, tokens: int, dtype_bytes: int,
               device_type: str) -> tuple[int, int, ChunkPlan]:
    """(bytes, s″, plan): the least budget a layer call of T = ``tokens`` meets, as layers decide.

    :meth:`memfine.schedule.ChunkPolicy.least_memory_plan` at the most rows T routes (s″ = T·k).
    """
    rows = max_routed_rows(tokens, moe.num_experts, moe.top_k, moe.capacity_factor,
                           moe.min_capacity)
    least, need = ChunkPolicy(chunk, moe).least_memory_plan(rows, tokens, dtype_bytes,
                                                             device_type=device_type)
    return need, rows, least
