"""Analytic activation-memory model (bytes, integer arithmetic; allocates nothing).

FIRST CUT — to be itemised and validated against measurement (issue: memory model). The two
functions below are the interface the chunk planner relies on; keep their signatures.

Legend: T tokens, S received rows (s′), D = d, N = n, G = 2n (gated) or n, K = k.
Reference: MemFine Eq. 2, 8 (arXiv 2511.21431); DESIGN.md §4-§5.
"""

from __future__ import annotations

from memfine.config import MoEConfig


def expert_row_bytes(moe: MoEConfig, dtype_bytes: int, *, recompute: str = "experts") -> int:
    """Peak bytes that scale with the received rows of one chunk, per row (s′ = 1).

    Saved H (G) plus the backward transients of one chunk (gathered x and dO: 2·d; A, dA: 2·n;
    dH: G; dx rows: d), in elements × ``dtype_bytes``, plus int32 index bytes.
    """
    G, D, N = moe.up_width, moe.hidden_size, moe.intermediate_size
    return (G + 3 * D + 2 * N + G) * dtype_bytes + 16


def expert_fixed_bytes(num_tokens: int, moe: MoEConfig, dtype_bytes: int, *,
                       recompute: str = "experts") -> int:
    """Bytes of the expert part that do not scale with the received rows (first cut: x and dx)."""
    return 2 * num_tokens * moe.hidden_size * dtype_bytes
