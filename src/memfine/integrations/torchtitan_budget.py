"""Budget of memfine's experts inside torchtitan: the memory model at the run's T, and the choices.

At its first forward each converted routed-experts block
(:class:`~memfine.integrations.torchtitan_modules.MemfineRoutedExperts`) evaluates memfine's
memory model (:class:`memfine.schedule.ChunkPolicy`, :func:`memfine.memory.layer.chunk_bytes`)
at the tokens it receives and logs one line: the bytes that do not scale with the tokens, the
bytes that do (at c = 1, divided by c with chunks), and the smallest budget the largest chunk bin
can meet. :func:`budget_report` returns these per block; :func:`last_decisions` the chunk count
each block used in its last forward. Nothing here imports torchtitan.

Reference: MemFine Eq. 8 (fixed + s′ · row bytes), Eq. 9 and §4.2 (bins, MACT); docs/torchtitan.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from memfine.config import ChunkConfig
from memfine.schedule.policy import ChunkPolicy
from memfine.units import format_bytes

BUDGET_ATTRIBUTE = "memfine_budget"
DECISION_ATTRIBUTE = "memfine_last_decision"


@dataclass(frozen=True, slots=True)
class ExpertsBudget:
    """The memory model of one routed-experts block at one step's shapes (MemFine Eq. 8).

    The block's modelled peak with c chunks is ``fixed_bytes + row_bytes · ⌈rows / c⌉``.

    Attributes:
        tokens: T, tokens entering the block on this rank.
        rows: s″, rows its experts receive (T·k without expert parallelism).
        dtype_bytes: D_t, bytes per activation element.
        fixed_bytes: bytes that do not scale with the tokens of a chunk (output, input and
            weight gradients, routing tensors).
        token_bytes: bytes that scale with the tokens, at c = 1 (``row_bytes · rows``).
        row_bytes: bytes per received row of one chunk.
        largest_bin: the largest chunk count a budget may choose (``ChunkConfig.bins[-1]``).
        smallest_feasible_budget_bytes: ``fixed_bytes + row_bytes · ⌈rows / largest_bin⌉``,
            the least ``memory_budget`` that runs (smaller ones are refused).
    """

    tokens: int
    rows: int
    dtype_bytes: int
    fixed_bytes: int
    token_bytes: int
    row_bytes: int
    largest_bin: int
    smallest_feasible_budget_bytes: int

    def predicted_peak_bytes(self, num_chunks: int) -> int:
        """Modelled peak bytes of the block with c = ``num_chunks`` chunks."""
        return self.fixed_bytes + self.row_bytes * math.ceil(self.rows / num_chunks)

    def describe(self) -> str:
        """One line: T, s″, the two parts and the smallest feasible budget."""
        return (f"T={self.tokens} tokens, s''={self.rows} rows, D_t={self.dtype_bytes}: "
                f"{format_bytes(self.fixed_bytes)} fixed + {format_bytes(self.token_bytes)} "
                f"scaling with the tokens (c=1, divided by c with chunks); smallest feasible "
                f"memory_budget {format_bytes(self.smallest_feasible_budget_bytes, exact=True)} "
                f"(c={self.largest_bin})")


@dataclass(frozen=True, slots=True)
class ExpertsDecision:
    """The chunking one routed-experts block used in its last forward.

    Same fields as ``memfine.schedule.ChunkDecision``, so that :func:`last_decisions` can return
    those unchanged once the chunk policy records them.

    Attributes:
        num_chunks: c.
        recompute: ``none``, ``experts`` or ``full`` (what each chunk recomputes in backward).
        tokens: s″, rows the block's experts received.
        predicted_peak_bytes: the memory model's peak of the block with this c.
        budget_bytes: the configured budget, or ``None`` for a fixed c.
    """

    num_chunks: int
    recompute: str
    tokens: int
    predicted_peak_bytes: int
    budget_bytes: int | None


def experts_budget(policy: ChunkPolicy, tokens: int, rows: int, dtype_bytes: int,
                   transport_row_elements: int = 0) -> ExpertsBudget:
    """Evaluate ``policy``'s memory model at one step's shapes.

    Args:
        policy: the block's chunk policy (its ``MoEConfig`` and ``ChunkConfig``).
        tokens: T, tokens entering the block.
        rows: s″, rows its experts receive.
        dtype_bytes: D_t.
        transport_row_elements: elements per received row held outside the experts (the
            received copy of x under expert parallelism: d; 0 otherwise).
    """
    line = policy.chunk_bytes(tokens, dtype_bytes, transport_row_elements=transport_row_elements)
    return ExpertsBudget(
        tokens=tokens, rows=rows, dtype_bytes=dtype_bytes, fixed_bytes=line.fixed_bytes,
        token_bytes=line.row_bytes * rows, row_bytes=line.row_bytes,
        largest_bin=policy.config.bins[-1],
        smallest_feasible_budget_bytes=policy.smallest_feasible_budget(
            rows, tokens, dtype_bytes, transport_row_elements=transport_row_elements))


def budget_chunk_config(chunk: ChunkConfig) -> ChunkConfig:
    """The chunk options the budget report models (what a budget would run).

    ``chunk`` itself under a budget; else its bins and recompute mode with a placeholder budget.
    """
    if chunk.memory_budget_bytes is not None:
        return chunk
    return ChunkConfig(memory_budget_bytes=1, bins=chunk.bins, recompute=chunk.recompute,
                       allow_over_budget=chunk.allow_over_budget)


def _converted(model: nn.Module, attribute: str) -> dict[str, object]:
    return {name: getattr(m, attribute, None) for name, m in model.named_modules()
            if hasattr(m, "memfine_config")}


def budget_report(model: nn.Module) -> dict[str, ExpertsBudget | None]:
    """Each converted block's :class:`ExpertsBudget` from its first forward (``None`` before).

    Args:
        model: a model converted by :func:`memfine.integrations.torchtitan.convert_model` or
            built from a converted config (FSDP/compile wrappers included).

    Returns:
        ``{qualified module name: ExpertsBudget | None}``.
    """
    return _converted(model, BUDGET_ATTRIBUTE)  # type: ignore[return-value]


def last_decisions(model: nn.Module) -> dict[str, ExpertsDecision | None]:
    """Each converted block's chunking in its last forward (``None`` before the first).

    Returns:
        ``{qualified module name: ExpertsDecision | None}``.
    """
    return _converted(model, DECISION_ATTRIBUTE)  # type: ignore[return-value]


def format_budget_report(model: nn.Module) -> str:
    """One line per converted block: its name and :meth:`ExpertsBudget.describe`."""
    return "\n".join(f"{name}: {budget.describe() if budget else 'no forward yet'}"
                     for name, budget in budget_report(model).items())
