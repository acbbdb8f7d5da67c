"""Expert selection: top-k with lowest-index tie-breaking, and group-limited routing.

Legend: T tokens, E experts, K top-k slots (groups are indexed without a suffix letter:
G already means 2n).
Reference: DeepSeek-V3 (arXiv 2412.19437) §2.1.2 (node-limited routing; HF ``n_group``,
``topk_group``); docs/design.md §2.
"""

from __future__ import annotations

import torch

from memfine.config import routing as config_routing


def top_k_lowest_index(select_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """The k largest entries of each row; among equal values the lower index wins.

    ``torch.topk`` leaves the order of ties unspecified (it differs between devices and
    versions), so it never ranks the scores themselves. A stable descending sort of each row
    fixes the order (one kernel on a GPU). On the CPU, fp32 scores (the router's) are ranked by
    a ``topk`` over unique int64 keys instead (:func:`_order_keys`: the value's
    order-preserving bits above the reversed column index), which picks what the sort picks at
    less time there; float64 (the references) takes the sort, and so does
    the CPU with :data:`memfine.config.routing.SORT_TOP_K_ON_CPU` (a GPU's path, counted). Either
    way the router and :mod:`memfine.reference` pick the same experts for tied scores.

    Args:
        select_TE: (T, E) float selection scores (may hold -inf).
        top_k: k in [1, E].

    Returns:
        (T, k) int64 column indices, best first; distinct within a row.

    Memory: keyed: transient (T, E) fp32 scratch, its (T, E) bool NaN mask, int32 sign mask and
    int64 keys, two (E,) int64 index vectors and the (T, k) int64 top-k values; the result is a
    new (T, k) tensor. Sorted: transient (T, E) sorted values and int64 order; the result is a
    (T, k) copy.
    """
    if (select_TE.dtype != torch.float32 or select_TE.device.type != "cpu"
            or config_routing.SORT_TOP_K_ON_CPU):
        order_TE = select_TE.sort(dim=-1, descending=True, stable=True).indices
        return order_TE[:, :top_k].contiguous()
    return _order_keys(select_TE).topk(top_k, dim=-1).indices


def _order_keys(select_TE: torch.Tensor) -> torch.Tensor:
    """(T, E) int64 keys ordered as (value descending, index ascending), unique in a row.

    The high 32 bits are the fp32 value's bits made monotone (a negative value's magnitude
    bits flipped), after -0.0 is made +0.0 and every NaN the canonical positive NaN, so equal
    values (and all NaNs, which a descending sort puts first) give equal high bits; the low 32
    bits are E − 1 − column, so the lower column wins among equal values.
    """
    E = select_TE.shape[-1]
    value_TE = select_TE + 0.0  # NOTE(memory): (T, E) fp32 scratch; -0.0 + 0.0 is +0.0
    value_TE.masked_fill_(value_TE != value_TE, float("nan"))  # one NaN bit pattern
    bits_TE = value_TE.view(torch.int32)
    sign_TE = bits_TE >> 31  # -1 where the sign bit is set, else 0
    bits_TE ^= sign_TE.bitwise_and_(0x7FFFFFFF)  # negative values: magnitude bits flipped
    del sign_TE
    keys_TE = bits_TE.to(torch.int64)
    del bits_TE, value_TE
    keys_TE.bitwise_left_shift_(32)
    return keys_TE.bitwise_or_(E - 1 - torch.arange(E, device=select_TE.device))


def group_limited_scores(select_TE: torch.Tensor, n_group: int, topk_group: int
                         ) -> torch.Tensor:
    """Mask the experts of every group a token may not use with -inf.

    A group's score is the sum of its two highest selection scores; each token keeps its
    ``topk_group`` best groups (ties: the lower group index). Experts of the other groups get
    -inf (never 0: scores and biased scores can be negative, and a 0 would then outrank them).

    Args:
        select_TE: (T, E) fp32 selection scores (scores plus any selection bias).
        n_group: expert groups, a divisor of E with E/n_group >= 2.
        topk_group: groups kept per token, in [1, n_group].

    Returns:
        (T, E) tensor, ``select_TE`` where the expert's group is kept, else -inf. With
        ``n_group == 1`` the input itself.

    Raises:
        ValueError: if E is not divisible by n_group, a group has fewer than 2 experts, or
            topk_group is not in [1, n_group].

    Reference: DeepSeek-V3 §2.1.2; HF ``DeepseekV3TopkRouter.get_topk_indices`` (group score =
    sum of the top-2 scores in the group).
    """
    if n_group == 1:
        return select_TE
    T, E = select_TE.shape
    if E % n_group or E // n_group < 2:
        raise ValueError(f"n_group must divide num_experts={E} with >= 2 experts per group, "
                         f"got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    by_group = select_TE.view(T, n_group, E // n_group)  # (T, n_group, E / n_group)
    group_score = by_group.topk(2, dim=-1).values.sum(-1)  # (T, n_group)
    keep_group = torch.zeros_like(group_score, dtype=torch.bool)
    keep_group.scatter_(1, top_k_lowest_index(group_score, topk_group), True)
    masked = by_group.masked_fill(~keep_group[:, :, None], float("-inf"))
    return masked.view(T, E)
