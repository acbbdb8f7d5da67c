"""Expert capacity and token dropping (optional; memfine routes dropless by default).

Legend: T tokens, E experts, K top-k slots.
Reference: GShard (arXiv 2006.16668) §2.2 and Switch Transformer (arXiv 2101.03961) §2.2
(capacity = capacity_factor·T·k/E); DeepSpeed-MoE ``min_capacity``; docs/design.md §2.
"""

from __future__ import annotations

import math
from typing import get_args

import torch

from memfine.config import DropPolicy


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                    min_capacity: int = 0) -> int:
    """Tokens one expert may receive: ``min(T, max(min_capacity, ⌈cf·T·k/E⌉))``.

    Clamped to T because a token sends at most one row to an expert, so an expert can never be
    offered more than T pairs (a capacity above T would only hide a configuration error).

    Args:
        num_tokens: T >= 0 (padding included: it is a shape, known without a device sync).
        num_experts: E >= 1.
        top_k: k >= 1.
        capacity_factor: cf > 0.
        min_capacity: lower bound in tokens, >= 0.

    Returns:
        The capacity in tokens, in [0, T].

    Raises:
        ValueError: on a negative T or min_capacity, or a non-positive E, k or cf.

    Reference: GShard §2.2; Switch Transformer §2.2; docs/design.md §2.
    """
    if num_tokens < 0 or min_capacity < 0:
        raise ValueError(f"num_tokens and min_capacity must be >= 0, got {num_tokens}, "
                         f"{min_capacity}")
    if num_experts < 1 or top_k < 1 or not capacity_factor > 0:
        raise ValueError(f"num_experts, top_k and capacity_factor must be > 0, got "
                         f"{num_experts}, {top_k}, {capacity_factor}")
    raw = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    return min(num_tokens, max(min_capacity, raw))


def max_routed_rows(num_tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float | None, min_capacity: int = 0) -> int:
    """The most (token, slot) pairs one routing of T tokens can keep: s″'s upper bound.

    Dropless (``capacity_factor`` None): every pair, T·k. With a capacity: at most
    ``min(T·k, E·capacity)``, each expert keeping at most :func:`expert_capacity` pairs.

    Args:
        num_tokens: T >= 0.
        num_experts: E >= 1.
        top_k: k >= 1.
        capacity_factor: cf > 0, or None for dropless routing.
        min_capacity: lower bound of the capacity in tokens, >= 0.

    Returns:
        Rows (int >= 0).

    Raises:
        ValueError: as :func:`expert_capacity`.

    Reference: GShard §2.2; Switch Transformer §2.2; docs/design.md §2.
    """
    pairs = num_tokens * top_k
    if capacity_factor is None:
        return pairs
    capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor, min_capacity)
    return min(pairs, num_experts * capacity)


def capacity_keep_mask(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       num_experts: int, capacity: int, drop_policy: DropPolicy = "probs"
                       ) -> torch.Tensor:
    """Which (token, slot) pairs fit their expert's capacity.

    Each expert ranks only the pairs that chose it (a dense (T, E) priority whose unselected
    cells are -inf, so negative weights never rank below an unselected pair) and keeps the
    first ``capacity``. ``probs`` ranks by routing weight, highest first; ``position`` by token
    index, earliest first. Equal priorities go to the lower token index (a stable sort).

    Args:
        top_k_index: (T, k) int64 expert ids; ids outside [0, E) (sentinels) are never kept.
        top_k_weights: (T, k) routing weights (read, not differentiated).
        num_experts: E.
        capacity: pairs each expert keeps, >= 0.
        drop_policy: ``probs`` or ``position``.

    Returns:
        (T, k) bool, True for kept pairs. No device sync.

    Raises:
        ValueError: on an unknown drop policy, a negative capacity or mismatched shapes.

    Memory: transient (T, E) fp32 priority, its int64 sort order and rank.

    Reference: GShard §2.2 (position), DeepSpeed-MoE / Megatron-Core ``drop_policy`` (probs).
    """
    if drop_policy not in get_args(DropPolicy):
        raise ValueError(f"drop_policy must be one of {get_args(DropPolicy)}, "
                         f"got {drop_policy!r}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if top_k_weights.shape != top_k_index.shape or top_k_index.dim() != 2:
        raise ValueError(f"top_k_index and top_k_weights must both be (T, k), got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    T, K = top_k_index.shape
    E = num_experts
    valid_TK = (top_k_index >= 0) & (top_k_index < E)
    ids_TK = torch.where(valid_TK, top_k_index, E)  # sentinels → a spare column E
    if drop_policy == "probs":
        priority_TK = top_k_weights.detach().float()
    else:
        priority_TK = -torch.arange(T, device=ids_TK.device, dtype=torch.float32)[:, None]
        priority_TK = priority_TK.expand(T, K)
    priority_TE = torch.full((T, E + 1), float("-inf"), device=ids_TK.device)
    priority_TE.scatter_(1, ids_TK, priority_TK)
    order_TE = priority_TE.sort(dim=0, descending=True, stable=True).indices
    rank_TE = torch.empty_like(order_TE)
    ranks = torch.arange(T, device=ids_TK.device)[:, None].expand(T, E + 1)
    rank_TE.scatter_(0, order_TE, ranks)
    return valid_TK & (rank_TE.gather(1, ids_TK) < capacity)
