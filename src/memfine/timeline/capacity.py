"""Allocation timeline of capacity routing: the keep mask, the drop count and the masked copies.

:func:`memfine.routing.capacity.capacity_keep_mask` ranks the pairs of each expert through a
dense (T, E + 1) priority, its int64 sort order and rank; :func:`memfine.routing.route` then
counts the dropped pairs and writes the sentinel id and weight 0 into copies of the index and
the weights. The expert part is modelled at its worst case, every pair kept (s″ = T·k): how
many pairs an expert drops depends on the routing, so the model is exact when no pair is
dropped and an upper bound otherwise.

Legend: T tokens, K = k, E experts, R router bytes.
Reference: our derivation from the code and torch.profiler's allocator events
(tests/memory/test_layer.py, router kinds); docs/design.md §5.
"""

from __future__ import annotations

from memfine.timeline.base import Timeline
from memfine.timeline.scores import Sizes


def _keep_mask(tl: Timeline, s: Sizes, drop_policy: str) -> str:
    """capacity_keep_mask: the (T, K) bool mask of kept pairs; its temporaries freed."""
    T, K, E = s.T, s.K, s.E
    ge, lt = tl.alloc("cap.ge", T * K), tl.alloc("cap.lt", T * K)
    valid = tl.alloc("cap.valid", T * K)
    tl.free(ge, lt)
    ids = tl.alloc("cap.ids", T * K * 8)
    temps = [valid, ids]
    if drop_policy == "position":  # -arange(T) as fp32
        arange = tl.alloc("cap.arange", T * 4)
        temps.append(tl.alloc("cap.priority_TK", T * 4))
        tl.free(arange)
    priority = tl.alloc("cap.priority_TE", T * (E + 1) * 4)
    values = tl.alloc("cap.sort_values", T * (E + 1) * 4)
    order = tl.alloc("cap.sort_order", T * (E + 1) * 8)
    tl.free(tl.alloc("cap.sort_scratch", T * 8), values)
    rank = tl.alloc("cap.rank", T * (E + 1) * 8)
    ranks = tl.alloc("cap.ranks", T * 8)
    gathered = tl.alloc("cap.rank_TK", T * K * 8)
    bound = tl.alloc("cap.capacity_scalar", 8)  # the wrapped capacity of rank < capacity
    below = tl.alloc("cap.below_capacity", T * K)
    tl.free(bound, gathered)
    keep = tl.alloc("cap.keep", T * K)  # WhereBackward keeps it
    tl.free(below, *temps, priority, order, rank, ranks)
    return keep


def capacity_forward(tl: Timeline, s: Sizes, drop_policy: str, rt: dict[str, str],
                     weights: str) -> str:
    """Keep mask, dropped count, masked index and weights; returns the masked weights.

    Writes ``keep`` (freed by WhereBackward), ``dropped`` (0-dim int64, held by MoEAux) and
    ``masked_index`` (held with the graph by the routing replay's record) into ``rt``.
    """
    T, K = s.T, s.K
    rt["keep"] = _keep_mask(tl, s, drop_policy)
    lt = tl.alloc("cap.valid_ids", T * K)
    total = tl.alloc("cap.sum_valid", 8)
    tl.free(tl.alloc("cap.sum_scratch", T * K * 8), lt)
    kept = tl.alloc("cap.sum_kept", 8)
    tl.free(tl.alloc("cap.sum_scratch", T * K * 8))
    rt["dropped"] = tl.alloc("aux.dropped_pairs", 8)
    tl.free(total, kept)
    rt["masked_index"] = tl.alloc("router.masked_index", T * K * 8)
    return tl.alloc("router.masked_weights", T * K * s.r)


def capacity_backward(tl: Timeline, s: Sizes, rt: dict[str, str], grad: str) -> str:
    """WhereBackward of the masked weights: the gradient where kept; the mask is freed."""
    out = tl.alloc("rbwd.dmasked", s.tk)
    tl.free(grad, rt.pop("keep"))
    return out
