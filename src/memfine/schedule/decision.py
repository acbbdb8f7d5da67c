"""What a chunk policy decides and reports: the plan of a call, its record, the budget error.

:class:`ChunkPlan` is how one MoE layer call runs (c and the fused row blocks);
:class:`ChunkDecision` is the policy's record of it (with the prediction and the budget);
:class:`InfeasibleBudgetError` is a budget that no candidate meets.

Reference: MemFine (arXiv 2511.21431) Eq. 8-9, §4.2 (MACT); docs/design.md §4.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from memfine.units import format_bytes

AgreeNumChunks = Callable[[int], int]
"""``agree(c_local) -> c_group``: the group's maximum of every rank's local choice.

Called once per budget-driven decision (per step and MoE layer, in forward only, never during
recompute), on every rank of the group in the same order. Its argument is the local chunk count:
a configured bin, or a value above the largest bin when this rank cannot meet its budget (so that
all ranks reach the same verdict). It must return the maximum over the group (an all-reduce MAX).
"""

CONFIG_NAMES = {"budget": "ChunkConfig.memory_budget_bytes", "bins": "ChunkConfig.bins",
                "allow": "ChunkConfig.allow_over_budget"}
"""How the over-budget message names the three settings (the library's field names)."""

FLAG_NAMES = {"budget": "--memory-budget", "bins": "--bins", "allow": "--allow-over-budget"}
"""The same settings as ``memfine train`` flags (used by the command line's messages)."""


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """The rows each chunk of an expert-parallel call moves, per candidate c (from notify).

    Attributes:
        local_experts: L, the experts on this rank (E / ep).
        rows: c → per chunk in token order, (M rows this rank sends, S rows it receives);
            :func:`chunk_rows_of` reads them from the count exchange.
    """

    local_experts: int
    rows: Mapping[int, Sequence[tuple[int, int]]]


class CountTables(Protocol):
    """The count exchange's result as :func:`chunk_rows_of` reads it (``ExpertCounts``)."""

    @property
    def candidates(self) -> tuple[int, ...]: ...  # noqa: D102

    @property
    def recv_counts_PCL(self) -> Any: ...  # noqa: D102,N802

    def send_counts(self, num_chunks: int) -> Any: ...  # noqa: D102

    def recv_counts(self, num_chunks: int) -> Any: ...  # noqa: D102


def chunk_rows_of(counts: CountTables) -> ChunkRows:
    """Per candidate c, every chunk's (rows sent, rows received) from the exchanged counts.

    ``send_counts(c)`` (c, E) summed over experts, ``recv_counts(c)`` (e, c, L) over source
    ranks and local experts; host integers (the counts are CPU tensors, no collective).
    """
    rows: dict[int, Sequence[tuple[int, int]]] = {
        c: tuple(zip(counts.send_counts(c).sum(1).tolist(),
                     counts.recv_counts(c).sum((0, 2)).tolist(), strict=True))
        for c in counts.candidates}
    return ChunkRows(local_experts=int(counts.recv_counts_PCL.shape[2]), rows=rows)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How one MoE layer call runs: its chunk count and its fused path's rows per row block.

    Attributes:
        num_chunks: c ≥ 1.
        block_rows: rows per row block of the routed experts' fused forward and backward (≥ 1;
            resolved by the chunk policy from ``MoEConfig.backward_block_bytes`` or a budget's
            rung, :func:`memfine.config.ladder_block_rows`), or None where no policy planned
            the call (the experts then run their config's own,
            :func:`memfine.config.config_block_rows`).
    """

    num_chunks: int
    block_rows: int | None = None


@dataclass(frozen=True, slots=True)
class ChunkDecision:
    """What one MoE layer call ran with: chunk count, recompute mode and the prediction.

    Attributes:
        num_chunks: c, token chunks of the expert part.
        recompute: ``none``, ``experts`` or ``full``.
        rows: s″, rows this rank's experts received (budgeted calls); with a fixed c no count
            is read (no host sync), and this is the routed slots T·k, an upper bound.
        predicted_peak_bytes: the memory model's peak of the layer's forward + backward at this
            c (bytes; :func:`memfine.memory.layer.layer_peak_bytes`, or for a budgeted
            expert-parallel call :func:`memfine.memory.layer.ep_layer_peak_bytes`).
        budget_bytes: the budget the choice was made against; None for a fixed c.
        block_rows: the fused path's rows per row block the call ran and the prediction
            assumed (the config's ``backward_block_bytes`` in rows, None's being the device
            default's; under a budget the largest of :func:`memfine.config.ladder_block_rows`
            that fits).
    """

    num_chunks: int
    recompute: str
    rows: int
    predicted_peak_bytes: int
    budget_bytes: int | None
    block_rows: int


class InfeasibleBudgetError(ValueError):
    """A memory budget that no chunk count in the bins meets (a ``ValueError``).

    Attributes:
        budget_bytes: the budget given.
        smallest_feasible_bytes: the least budget some bin meets (for this T and s″).
        bins: the bins tried.
        reason: why, in words (without the setting names).
    """

    def __init__(self, budget_bytes: int, smallest_feasible_bytes: int, bins: tuple[int, ...],
                 reason: str, names: dict[str, str] | None = None) -> None:
        """Keep the numbers; the message names the settings by ``names`` (default fields)."""
        self.budget_bytes, self.smallest_feasible_bytes = budget_bytes, smallest_feasible_bytes
        self.bins, self.reason = bins, reason
        super().__init__(self.message(names or CONFIG_NAMES))

    def message(self, names: dict[str, str]) -> str:
        """One line naming the settings as ``names`` spells them (fields or flags)."""
        return (f"{names['budget']} {format_bytes(self.budget_bytes, exact=True)} cannot be met "
                f"by any chunk count in {names['bins']} {','.join(map(str, self.bins))}: "
                f"{self.reason}; the smallest feasible budget is "
                f"{format_bytes(self.smallest_feasible_bytes, exact=True)}; raise "
                f"{names['budget']}, add a larger bin to {names['bins']}, or set "
                f"{names['allow']} to run with the largest bin")
