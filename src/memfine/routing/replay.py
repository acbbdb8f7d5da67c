"""Routing replay: a router re-run inside a recompute reuses the forward's decision.

``MoELayer`` routes once, outside its own recomputed regions. A user may still wrap the whole
layer (or a block around it) in ``torch.utils.checkpoint``; backward then re-runs the router on a
recomputed input that can differ in the last bit, and with near-tied logits a re-decided top-k
would send gradients to experts the forward never used. :class:`RoutingReplay` records each
grad-enabled forward decision and hands it back when the router runs inside a backward pass
(a recompute), so only the weights are recomputed (with their gradients), never the selection.

Records live exactly as long as the autograd graph of their forward: each one is held by a node
of that graph (:class:`_Anchor`) and referenced here only weakly, so a forward whose graph is
freed (after backward, or when its outputs are dropped) leaves nothing behind.

Reference: docs/design.md §2 ("recomputation never re-decides routing"); MemFine §4.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memfine.routing.router import RoutingResult


class _Record:
    """One forward's selection: ``selected_index`` and ``top_k_index`` (T, k) int64."""

    __slots__ = ("__weakref__", "selected_index", "top_k_index")

    def __init__(self, result: RoutingResult) -> None:
        self.selected_index = result.selected_index.detach()
        self.top_k_index = (self.selected_index if result.top_k_index is result.selected_index
                            else result.top_k_index.detach())


class _Anchor(torch.autograd.Function):
    """Identity on the routing weights whose graph node keeps a :class:`_Record` alive."""

    @staticmethod
    def forward(ctx: Any, weights: torch.Tensor, record: _Record) -> torch.Tensor:
        ctx.record = record  # NOTE(memory): two (T, k) int64 tensors, freed with the graph
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None  # None: record


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a checkpoint recompute runs then)."""
    return bool(torch._C._current_graph_task_id() != -1)


class RoutingReplay:
    """Per-router stack of forward decisions, replayed last-in first-out by recomputes.

    Backward visits checkpointed regions in reverse order of their forwards, so the most recent
    unconsumed decision with the same token count belongs to the region being recomputed.
    """

    def __init__(self) -> None:
        """Start with no records."""
        self._records: list[weakref.ref[_Record]] = []

    def record(self, result: RoutingResult) -> torch.Tensor:
        """Remember ``result``'s selection for as long as its graph lives.

        Args:
            result: the forward's :class:`RoutingResult` (its weights require grad).

        Returns:
            ``result.top_k_weights`` passed through an identity node that owns the record; use
            it in place of the original weights.
        """
        out: torch.Tensor = _Anchor.apply(result.top_k_weights, self.keep(result))
        return out

    def keep(self, result: RoutingResult) -> _Record:
        """Remember ``result``'s selection for as long as the caller holds the returned record.

        Args:
            result: the forward's :class:`RoutingResult`.

        Returns:
            The record (two (T, k) int64 tensors, shared with ``result``): hold it in a node of
            the forward's graph (:class:`memfine.router_node.RouterNode` keeps it on its
            context), so that it lives exactly as long as that graph.
        """
        rec = _Record(result)
        self._records = [r for r in self._records if r() is not None]
        self._records.append(weakref.ref(rec))
        return rec

    def take(self, num_tokens: int) -> RoutingResult:
        """The most recent live decision for ``num_tokens`` tokens (removed from the stack).

        Returns:
            A :class:`RoutingResult` holding only the index fields (pass it as ``replay`` to
            :func:`memfine.routing.route`).

        Raises:
            RuntimeError: when no decision is recorded: the router runs in a backward pass but
                its forward kept no graph (e.g. ``torch.utils.checkpoint(use_reentrant=True)``,
                whose forward runs without grad). Routing is then never re-decided silently.
        """
        for i in range(len(self._records) - 1, -1, -1):
            rec = self._records[i]()
            if rec is not None and rec.selected_index.shape[0] == num_tokens:
                del self._records[i]
                empty = rec.selected_index.new_zeros(0)
                return RoutingResult(top_k_index=rec.top_k_index, top_k_weights=empty,
                                     logits=empty, scores=empty, tokens_per_expert=empty,
                                     selected_index=rec.selected_index)
        raise RuntimeError(
            "the MoE router is running inside a backward pass (an activation-checkpoint "
            f"recompute) but no forward decision for {num_tokens} tokens was recorded, so its "
            "routing cannot be replayed; use torch.utils.checkpoint(..., use_reentrant=False) "
            "around MoELayer, or memfine's own recompute (ChunkConfig.recompute)")
