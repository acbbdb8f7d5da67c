"""The MoEBlaze routing index: four int32 arrays that replace the permuted T·k × d activation copy.

Legend: T tokens, E experts, K top-k slots, S routed rows (valid (token, slot) pairs, ≤ T·k).
Sentinel ids (outside [0, E): padding, expert-parallel remote experts, dropped pairs) are never
dispatched: they get no row and ``token_index_map`` holds -1 for them.
Reference: MoEBlaze (arXiv 2601.05296) §3-§4; docs/design.md §3 (worked example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# The dense T×E map of the sort-free builder costs T·E·8 bytes (int64 scan); above this we use
# the argsort builder, whose workspace is O(T·k).
SORT_FREE_MAX_CELLS = 1 << 22


@dataclass(frozen=True, slots=True)
class RoutingIndex:
    """The four MoEBlaze index arrays (plus the per-row slot id) for one routing decision.

    Attributes:
        expert_token_indices: (S,) int32 token id of each routed row, rows grouped by expert,
            ascending token id within an expert.
        expert_token_offsets: (E + 1,) int32 exclusive prefix sum of per-expert row counts; expert
            e owns rows [off[e], off[e+1]); off[0] = 0, off[E] = S.
        token_expert_indices: (T, k) int32 the experts of each token in token order (sentinels
            kept).
        token_index_map: (T, k) int32 row of slot (t, j) in the expert-grouped order, -1 for a
            sentinel slot.
        expert_slot_indices: (S,) int32 flat slot id t·k + j of each row (used to read the row's
            routing weight); ``expert_token_indices == expert_slot_indices // k``.
        num_experts: E.
    """

    expert_token_indices: torch.Tensor
    expert_token_offsets: torch.Tensor
    token_expert_indices: torch.Tensor
    token_index_map: torch.Tensor
    expert_slot_indices: torch.Tensor
    num_experts: int

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.token_index_map.shape[0])

    @property
    def top_k(self) -> int:
        """The number k of top-k slots per token."""
        return int(self.token_index_map.shape[1])

    @property
    def num_rows(self) -> int:
        """S, routed rows (valid (token, slot) pairs)."""
        return int(self.expert_token_indices.shape[0])

    def tokens_per_expert(self) -> torch.Tensor:
        """(E,) int32 rows per expert (differences of the offsets)."""
        return self.expert_token_offsets.diff()


def _check_top_k_index(top_k_index: torch.Tensor, num_experts: int) -> None:
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be (T, k), got shape {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"top_k_index must be int64 or int32, got {top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")


def build_index_argsort(top_k_index: torch.Tensor, num_experts: int) -> RoutingIndex:
    """Build the routing index with one stable argsort over the T·k slots.

    Args:
        top_k_index: (T, k) int64/int32 expert ids; ids outside [0, E) are sentinels.
        num_experts: E.

    Returns:
        The :class:`RoutingIndex`. Workspace O(T·k) int64.

    Raises:
        ValueError: on a wrong shape or dtype.

    Reference: the counting-sort fallback of MoEBlaze §3; torchtitan's argsort dispatch.
    """
    _check_top_k_index(top_k_index, num_experts)
    T, k = top_k_index.shape
    E = num_experts
    flat_M = top_k_index.reshape(-1).long()
    valid_M = (flat_M >= 0) & (flat_M < E)
    key_M = torch.where(valid_M, flat_M, E)
    order_M = torch.argsort(key_M, stable=True)
    counts_E = torch.bincount(key_M, minlength=E + 1)[:E]
    S = int(counts_E.sum())
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=flat_M.device)
    offsets[1:] = counts_E.cumsum(0)
    row_of_slot_M = torch.empty_like(order_M)
    row_of_slot_M[order_M] = torch.arange(T * k, device=flat_M.device)
    row_of_slot_M = torch.where(valid_M, row_of_slot_M, -1)
    slots_S = order_M[:S]
    return RoutingIndex(
        expert_token_indices=(slots_S // k).int(),
        expert_token_offsets=offsets.int(),
        token_expert_indices=top_k_index.int(),
        token_index_map=row_of_slot_M.view(T, k).int(),
        expert_slot_indices=slots_S.int(),
        num_experts=E,
    )


def build_index_sort_free(top_k_index: torch.Tensor, num_experts: int) -> RoutingIndex:
    """Build the routing index without sorting, from a dense T×E token map.

    Steps (MoEBlaze §3): (1) dense map, cell (t, e) set when token t chose e (no collisions: a
    token's k experts are distinct); (2) per-expert counts and their exclusive prefix sum give the
    offsets; (3) a per-expert inclusive scan over tokens gives each set cell its row.

    Args:
        top_k_index: (T, k) int64/int32 expert ids, distinct within a token; ids outside [0, E)
            are sentinels.
        num_experts: E.

    Returns:
        The :class:`RoutingIndex`, identical to :func:`build_index_argsort`. Workspace T·E·9 bytes.

    Raises:
        ValueError: on a wrong shape or dtype, or an expert id repeated within a token.

    Reference: MoEBlaze §3 (sort-free index construction).
    """
    _check_top_k_index(top_k_index, num_experts)
    T, k = top_k_index.shape
    E = num_experts
    dev = top_k_index.device
    idx_TK = top_k_index.long()
    valid_TK = (idx_TK >= 0) & (idx_TK < E)
    safe_TK = torch.where(valid_TK, idx_TK, E)  # sentinels land in a spare column E
    dense_TE = torch.zeros(T, E + 1, dtype=torch.int64, device=dev)
    dense_TE.scatter_add_(1, safe_TK, torch.ones_like(safe_TK))
    dense_TE = dense_TE[:, :E]
    if T and int(dense_TE.max()) > 1:
        raise ValueError("top_k_index must hold distinct experts within each token")
    counts_E = dense_TE.sum(0)
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = counts_E.cumsum(0)
    row_TE = dense_TE.cumsum(0) - 1 + offsets[:E]  # row of cell (t, e) when it is set
    row_TK = torch.where(valid_TK, row_TE.gather(1, safe_TK.clamp(max=E - 1)), -1)
    S = int(offsets[E])
    slot_TK = torch.arange(T * k, device=dev).view(T, k)
    expert_slot = torch.empty(S, dtype=torch.int64, device=dev)
    expert_slot[row_TK[valid_TK]] = slot_TK[valid_TK]
    return RoutingIndex(
        expert_token_indices=(expert_slot // k).int(),
        expert_token_offsets=offsets.int(),
        token_expert_indices=top_k_index.int(),
        token_index_map=row_TK.int(),
        expert_slot_indices=expert_slot.int(),
        num_experts=E,
    )


def _repeats_an_expert(top_k_index: torch.Tensor, num_experts: int) -> bool:
    """True when some token lists one expert id in [0, E) more than once (a (T, k) row sort)."""
    if top_k_index.dim() != 2 or top_k_index.shape[1] < 2 or top_k_index.numel() == 0:
        return False
    sorted_TK = top_k_index.sort(dim=1).values
    same_TK = sorted_TK[:, 1:] == sorted_TK[:, :-1]
    valid_TK = (sorted_TK[:, 1:] >= 0) & (sorted_TK[:, 1:] < num_experts)
    return bool((same_TK & valid_TK).any())


def build_routing_index(top_k_index: torch.Tensor, num_experts: int,
                        builder: Literal["auto", "sort_free", "argsort"] = "auto") -> RoutingIndex:
    """Build the routing index with the chosen builder.

    Args:
        top_k_index: (T, k) int64/int32 expert ids (sentinels outside [0, E) allowed). A token
            may repeat an expert (e.g. DeepSeek-V4's hash routing): each slot then gets its own
            row, as a per-token loop computes it; only the sort-free builder refuses that.
        num_experts: E.
        builder: ``sort_free``, ``argsort``, or ``auto`` (sort-free while T·E ≤
            ``SORT_FREE_MAX_CELLS`` and no token repeats an expert, else argsort).

    Returns:
        The :class:`RoutingIndex`.

    Raises:
        ValueError: on an unknown builder, or from the builders.
    """
    if builder == "auto":
        small = top_k_index.shape[0] * num_experts <= SORT_FREE_MAX_CELLS
        builder = "sort_free" if small and not _repeats_an_expert(top_k_index, num_experts) \
            else "argsort"
    if builder == "sort_free":
        return build_index_sort_free(top_k_index, num_experts)
    if builder == "argsort":
        return build_index_argsort(top_k_index, num_experts)
    raise ValueError(f"builder must be 'auto', 'sort_free' or 'argsort', got {builder!r}")
