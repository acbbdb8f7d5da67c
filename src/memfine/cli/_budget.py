"""``memfine train --memory-budget``: refuse a budget that no chunk count meets, up front.

A MACT budget (MemFine Eq. 8-9) is met when the largest bin c_max keeps one chunk's bytes within
it: fixed + ⌈s″ / c_max⌉ · row ≤ budget, with the memory model's fixed and per-row bytes of one
MoE layer call (:meth:`memfine.schedule.policy.ChunkPolicy.smallest_feasible_budget`, the same
policy object and numbers the layers use at run time). On one process, a training step's MoE
layer sees T = B·Q tokens (``--batch-size`` × ``--seq-len``; evaluation batches are the same size
and sampling fewer) and receives at most s″ = T·k rows (fewer with a capacity factor:
:func:`memfine.routing.max_routed_rows`), so the budget either holds for every call or fails
at the first: the check refuses it before any file is written.

Under torchrun the rows a rank receives depend on the other ranks' routing (expert parallelism),
so the policy checks each call at run time, as it does for library users.
"""

from __future__ import annotations

from memfine.config import TrainConfig
from memfine.routing import max_routed_rows
from memfine.schedule.policy import ChunkPolicy
from memfine.units import DTYPE_BYTES, format_bytes


def check_memory_budget(config: TrainConfig, world_size: int = 1) -> None:
    """Refuse a ``--memory-budget`` that no chunk count in ``--bins`` can meet.

    Nothing is checked without a budget, with ``--allow-over-budget`` (the run then uses the
    largest bin with a warning), or under torchrun (``world_size`` > 1).

    Args:
        config: the resolved run configuration.
        world_size: torchrun's ``WORLD_SIZE`` (1 on one process).

    Raises:
        ValueError: one line naming ``--memory-budget``, the value given, the smallest feasible
            budget for this model and batch (bytes and MiB/GiB), and what to change.

    Reference: MemFine Eq. 8 (s′_max) and Eq. 9 with MACT's bins (§4.2).
    """
    chunk, moe = config.model.chunk, config.model.moe
    budget = chunk.memory_budget_bytes
    if budget is None or chunk.allow_over_budget or world_size > 1:
        return
    T = config.batch_size * config.seq_len
    rows = max_routed_rows(T, moe.num_experts, moe.top_k, moe.capacity_factor, moe.min_capacity)
    dtype_bytes = DTYPE_BYTES[config.dtype]
    policy = ChunkPolicy(chunk, moe)
    need = policy.smallest_feasible_budget(rows, T, dtype_bytes)
    if budget >= need:
        return
    line = policy.chunk_bytes(T, dtype_bytes)
    c_max = chunk.bins[-1]
    per_chunk = (need - line.fixed_bytes) // line.row_bytes  # the rows of one chunk at c_max
    if budget < line.fixed_bytes:
        remedy = "raise --memory-budget or lower --batch-size or --seq-len"
    else:
        remedy = "raise --memory-budget, add a larger bin to --bins, or lower --batch-size"
    raise ValueError(
        f"--memory-budget {format_bytes(budget, exact=True)} cannot be met by any chunk count in "
        f"--bins {','.join(map(str, chunk.bins))}; the smallest feasible budget for this model "
        f"and batch is {format_bytes(need, exact=True)}: one MoE layer call holds "
        f"{format_bytes(line.fixed_bytes, exact=True)} that no chunk count reduces (T={T} "
        f"tokens = --batch-size {config.batch_size} x --seq-len {config.seq_len}, "
        f"{config.dtype}) plus {line.row_bytes} bytes per received row, and at c={c_max} a chunk "
        f"holds {per_chunk} of the s''={rows} rows; {remedy} (--allow-over-budget runs at "
        f"c={c_max} over the budget)")
