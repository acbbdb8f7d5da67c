"""Budget of memfine's experts inside torchtitan: the memory model at the run's T, and the choices.

At its first forward each converted routed-experts block
(:class:`~memfine.integrations.torchtitan_modules.MemfineRoutedExperts`) evaluates memfine's
exact memory model (:class:`memfine.schedule.ChunkPolicy`: the allocation timeline of the
block's forward + backward, :func:`memfine.memory.layer.layer_peak_bytes`) at the tokens it
receives and logs one line: the bytes that do not scale with the tokens (the peak at T = 0),
the bytes that do (the peak at c = 1 above those), the exact peak of every chunk bin and the
smallest budget some bin meets. :func:`budget_report` returns these per block;
:func:`last_decisions` the :class:`memfine.schedule.ChunkDecision` of each block's last forward.
Nothing here imports torchtitan.

Reference: MemFine Eq. 8-9 and §4.2 (bins, MACT), with memfine's exact model; docs/torchtitan.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from memfine.config import ChunkConfig
from memfine.schedule.policy import ChunkDecision, ChunkPolicy, block_text
from memfine.units import format_bytes

BUDGET_ATTRIBUTE = "memfine_budget"


@dataclass(frozen=True, slots=True)
class ExpertsBudget:
    """The exact memory model of one routed-experts block at one step's shapes (bytes).

    Attributes:
        tokens: T, tokens entering the block on this rank.
        rows: s″, rows its experts receive (T·k without expert parallelism).
        dtype_bytes: D_t, bytes per activation element.
        fixed_bytes: the predicted peak at T = 0 (nothing routed): bytes that do not scale with
            the tokens.
        token_bytes: the predicted peak at c = 1 minus ``fixed_bytes``: what scales with the
            tokens (chunks shrink the part one chunk holds at a time).
        bins: the chunk counts a budget may choose (``ChunkConfig.bins``).
        bin_peak_bytes: the predicted peak of the block at each bin, in the order of ``bins``,
            at the device's default row blocks
            (:meth:`memfine.schedule.ChunkPolicy.predicted_peak`).
        smallest_feasible_budget_bytes: the least ``memory_budget`` some bin meets, at the
            row blocks a budget may run (:meth:`memfine.schedule.ChunkPolicy.
            smallest_feasible_budget`; smaller ones are refused).
        least_memory_bin: the c of that least peak.
        least_memory_block_rows: its rows per fused row block: the device default's, or half
            or a quarter of them (:func:`memfine.config.ladder_block_rows`).
    """

    tokens: int
    rows: int
    dtype_bytes: int
    fixed_bytes: int
    token_bytes: int
    bins: tuple[int, ...]
    bin_peak_bytes: tuple[int, ...]
    smallest_feasible_budget_bytes: int
    least_memory_bin: int
    least_memory_block_rows: int | None

    def describe(self) -> str:
        """One line: T, s″, the two parts, each bin's peak and the smallest feasible budget."""
        peaks = ", ".join(f"c={c} {format_bytes(p)}"
                          for c, p in zip(self.bins, self.bin_peak_bytes, strict=True))
        return (f"T={self.tokens} tokens, s''={self.rows} rows, D_t={self.dtype_bytes}: "
                f"{format_bytes(self.fixed_bytes)} fixed + {format_bytes(self.token_bytes)} "
                f"scaling with the tokens (c=1); predicted peak {peaks}; smallest feasible "
                f"memory_budget {format_bytes(self.smallest_feasible_budget_bytes, exact=True)} "
                f"(c={self.least_memory_bin}, "
                f"{block_text(self.least_memory_block_rows)})")


def experts_budget(policy: ChunkPolicy, tokens: int, rows: int, dtype_bytes: int,
                   transport_row_elements: int = 0, device_type: str = "cpu") -> ExpertsBudget:
    """Evaluate ``policy``'s exact memory model at one step's shapes.

    Args:
        policy: the block's chunk policy (its ``MoEConfig`` and ``ChunkConfig``: bins and
            recompute mode).
        tokens: T, tokens entering the block.
        rows: s″, rows its experts receive.
        dtype_bytes: D_t.
        transport_row_elements: elements per received row held outside the experts (the
            received copy of x under expert parallelism: d; 0 otherwise).
        device_type: the activations' device type (the row blocks the layer runs there).

    Raises:
        ValueError: on negative ``tokens`` or ``rows`` (from the memory model).
    """
    def peak(recv_rows: int, num_tokens: int, num_chunks: int) -> int:
        return policy.predicted_peak(recv_rows, num_tokens, dtype_bytes, num_chunks,
                                     transport_row_elements=transport_row_elements,
                                     device_type=device_type)

    fixed = peak(0, 0, 1)
    bins = policy.config.bins
    least, least_peak = policy.least_memory_plan(
        rows, tokens, dtype_bytes, transport_row_elements=transport_row_elements,
        device_type=device_type)
    return ExpertsBudget(
        tokens=tokens, rows=rows, dtype_bytes=dtype_bytes, fixed_bytes=fixed,
        token_bytes=peak(rows, tokens, 1) - fixed, bins=bins,
        bin_peak_bytes=tuple(peak(rows, tokens, c) for c in bins),
        smallest_feasible_budget_bytes=least_peak, least_memory_bin=least.num_chunks,
        least_memory_block_rows=least.block_rows)


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
    """Each converted block's :class:`ExpertsBudget` of its latest forward (``None`` before).

    Args:
        model: a model converted by :func:`memfine.integrations.torchtitan.convert_model` or
            built from a converted config (FSDP/compile wrappers included).

    Returns:
        ``{qualified module name: ExpertsBudget | None}``.
    """
    return _converted(model, BUDGET_ATTRIBUTE)  # type: ignore[return-value]


def last_decisions(model: nn.Module) -> dict[str, ChunkDecision | None]:
    """Each converted block's ``last_decision``: its chunking in its last forward.

    Returns:
        ``{qualified module name: ChunkDecision | None}`` (``None`` before the first forward).
    """
    return _converted(model, "last_decision")  # type: ignore[return-value]


def format_budget_report(model: nn.Module) -> str:
    """One line per converted block: its name and :meth:`ExpertsBudget.describe`."""
    return "\n".join(f"{name}: {budget.describe() if budget else 'no forward yet'}"
                     for name, budget in budget_report(model).items())
