"""Chunk-count planning: s′_max (MemFine Eq. 8) and the binned chunk count c (Eq. 9, MACT).

Reference: MemFine (arXiv 2511.21431) Eq. 8-9 and §4.2 (MACT); docs/design.md §4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

SEARCH_LIMIT = 2**48
"""The largest count :func:`largest_fitting` tries (tokens: far beyond any device's memory)."""


def s_prime_max(budget_bytes: int, fixed_bytes: int, row_bytes: int) -> int:
    """Largest tolerable received rows per chunk: ⌊(budget − fixed) / per-row bytes⌋.

    Args:
        budget_bytes: memory available to the part being planned, bytes.
        fixed_bytes: bytes that do not scale with the received rows.
        row_bytes: bytes per received row (> 0).

    Returns:
        s′_max in rows; ≤ 0 when even the fixed part does not fit.

    Reference: MemFine Eq. 8 (numerator: budget minus everything that does not scale with s′;
    denominator: the per-row activation bytes).
    """
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be > 0, got {row_bytes}")
    return (budget_bytes - fixed_bytes) // row_bytes


def largest_fitting(fits: Callable[[int], bool]) -> int:
    """The largest n ≥ 0 with ``fits(n)``, for a ``fits`` that holds up to a point and not after.

    Doubling from 1 until ``fits`` fails, then bisection: about 2·log2(n) calls. ``fits`` must
    be monotone (true on [0, n], false above); the exact layer model is (a test over a grid of
    shapes, dtypes, chunk counts and recompute modes).

    Args:
        fits: n → whether n fits (e.g. the predicted peak at T = n tokens is within a budget).

    Returns:
        n, or -1 when ``fits(0)`` is False; :data:`SEARCH_LIMIT` when every count up to it fits.

    Reference: MemFine Eq. 8 (s′_max: the largest tolerable size), found on the exact model
    instead of its straight line.
    """
    if not fits(0):
        return -1
    low, high = 0, 1  # fits(low); high is tried next
    while fits(high):
        low = high
        if high >= SEARCH_LIMIT:
            return SEARCH_LIMIT
        high = min(2 * high, SEARCH_LIMIT)
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    """MemFine Eq. 9's answer for one MoE layer: the chunk count it needs and the bin it gets.

    Attributes:
        chunks_needed: ⌈s″/s′_max⌉ (at least 1); ``None`` when s′_max ≤ 0 (the budget does not
            cover the bytes that do not scale with the rows: no chunk count is enough).
        num_chunks: the smallest bin ≥ ``chunks_needed``; ``None`` when no bin is large enough.
    """

    chunks_needed: int | None
    num_chunks: int | None

    @property
    def fits(self) -> bool:
        """True when a bin meets the budget."""
        return self.num_chunks is not None


def choose_num_chunks(recv_rows: int, s_max_rows: int, bins: tuple[int, ...]) -> ChunkChoice:
    """Eq. 9 with MACT's bins: the chunk count needed for s″ rows and the bin that holds it.

    Never raises for an infeasible budget: the caller decides (the policy raises or warns,
    ``memfine plan`` reports the shortfall).

    Args:
        recv_rows: s″, rows received (≥ 0).
        s_max_rows: s′_max, the most rows one chunk may hold (MemFine Eq. 8); may be ≤ 0.
        bins: allowed chunk counts, strictly increasing, e.g. (1, 2, 4, 8).

    Returns:
        The :class:`ChunkChoice` (``num_chunks`` = bins[0] when nothing is received and
        s′_max > 0).

    Raises:
        ValueError: if recv_rows < 0 or bins is empty.

    Reference: MemFine Eq. 9, binned as in MACT (§4.2).
    """
    if recv_rows < 0:
        raise ValueError(f"recv_rows must be >= 0, got {recv_rows}")
    if not bins:
        raise ValueError("bins must be a non-empty tuple of chunk counts, got ()")
    if s_max_rows <= 0:
        return ChunkChoice(chunks_needed=None, num_chunks=None)
    needed = max(1, math.ceil(recv_rows / s_max_rows))
    return ChunkChoice(chunks_needed=needed,
                       num_chunks=next((b for b in bins if b >= needed), None))


def s_prime_max_memfine(*, device_memory_bytes: int, alpha: float, static_bytes: int,
                        in_flight: int, t: int, cp: int, dtype_bytes: int, micro_batch: int,
                        seq_len: int, attention_width: int, expert_width: int) -> int:
    """MemFine Eq. 8 as printed: the largest tolerable received rows s′ per sequence.

    s′_max = ⌊(α·M_device − M_sta − (m_g/(t·cp))·D_t·b·s·A) / ((m_g/(t·cp))·D_t·b·B)⌋ with
    A = 5d + a·h_d + 2·k_a·h_d + E (attention/router width) and B = 2d + 2n (expert width), both
    from MemFine Table 2; α·M_device is taken as ``int(alpha * device_memory_bytes)`` bytes.

    Args:
        device_memory_bytes: M_device, bytes.
        alpha: usable fraction α in (0, 1].
        static_bytes: M_sta, bytes (parameters, gradients, optimizer state; add here anything
            else that does not scale with s′, e.g. checkpointed layer inputs).
        in_flight: m_g (1 under full recomputation).
        t: tensor-parallel size.
        cp: context-parallel size.
        dtype_bytes: D_t.
        micro_batch: b.
        seq_len: s.
        attention_width: A in elements per token.
        expert_width: B in elements per received row.

    Returns:
        s′_max in rows per sequence; ≤ 0 when the budget does not cover the rest.

    Raises:
        ValueError: if a size is < 1 or alpha is outside (0, 1].

    Reference: MemFine (arXiv 2511.21431) Eq. 8.
    """
    for name, value in (("in_flight", in_flight), ("t", t), ("cp", cp),
                        ("dtype_bytes", dtype_bytes), ("micro_batch", micro_batch),
                        ("seq_len", seq_len), ("expert_width", expert_width)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    scale = in_flight * dtype_bytes * micro_batch
    numerator = ((int(alpha * device_memory_bytes) - static_bytes) * t * cp
                 - scale * seq_len * attention_width)
    return numerator // (scale * expert_width)
