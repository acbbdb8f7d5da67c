"""The router and its aux losses as one autograd node that recomputes the logits in backward.

A plain autograd graph of the fp32 router keeps (T, E) tensors alive through the experts'
backward: the scores (softmax/sigmoid save their result), the losses' softmax and logits, and
the losses' (T, E) logit gradient, which their backward produces first and the engine holds in
the router's input buffer until the experts' backward reaches the logits. :class:`RouterNode`
runs the router, the capacity/padding masks, the replay record and the losses (with their
count collective, once) in forward without a graph and saves only the router input x (the
tensor the experts keep anyway), the router weight and the selection (small int tensors). Its
backward, which receives the gradients of the weights and of every loss at once, recomputes the
logits from x and W (one T·d·E GEMM, ≈ 2·T·d·E FLOPs), re-runs the differentiable part with the
forward's selection and drops (:func:`memfine.routing.route` with ``replay``) and the same loss
counts, and differentiates it: the (T, E) tensors live only inside the node's backward.

Legend: T tokens, E experts, K top-k slots, D hidden size.
Reference: docs/design.md §2 (router node), §5 (memory model); the losses as
:mod:`memfine.routing.losses`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memfine.config import RouteOptions
from memfine.routing.losses import load_balancing_loss, sequence_balance_loss, z_loss
from memfine.routing.precision import count_per_expert
from memfine.routing.replay import in_backward
from memfine.routing.router import RoutingResult, TopKRouter, route, router_dtype

CountsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LossCounts:
    """What the losses count: the global selection and the divisor, fixed in forward.

    Attributes:
        global_stats: (E + 1,) int64 selection counts and the number of shares (ranks, or
            ranks × micro-batches), summed over the global batch (this call's own when
            nothing is summed).
        counts_E: (E,) int64 global selection counts, or None on one process (the losses
            then count the local selection themselves).
        tokens_per_rank: 0-dim mean valid tokens per share Σ counts / (k·W), or None on one
            process (local means).
    """

    global_stats: torch.Tensor
    counts_E: torch.Tensor | None = None
    tokens_per_rank: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class AuxLosses:
    """The router's 0-dim fp32 losses: load balancing, z and (when computed) sequence-wise."""

    load_balancing: torch.Tensor
    z: torch.Tensor
    sequence: torch.Tensor | None = None


def selected_counts(routing: RoutingResult, mask_T: torch.Tensor | None) -> torch.Tensor:
    """(E,) int64 assignments of the router's selection over valid tokens (before drops).

    Sums to k·(valid tokens). Without padding or capacity drops this is
    ``routing.tokens_per_expert`` itself (no extra count).
    """
    if routing.selected_index is routing.top_k_index:
        return routing.tokens_per_expert
    E = routing.num_experts
    ids_TK = routing.selected_index
    if mask_T is not None:
        ids_TK = torch.where(mask_T[:, None], ids_TK, E)
    return count_per_expert(ids_TK, E)  # fixed shape: traceable by torch.compile


def loss_counts(routing: RoutingResult, mask_T: torch.Tensor | None, global_counts: CountsFn,
                step_counts: torch.Tensor | None = None) -> LossCounts:
    """The losses' counts: one ``global_counts`` call on (E + 1,) int64 (docs/design.md §2).

    Args:
        routing: the router's result.
        mask_T: (T,) bool valid tokens, or None.
        global_counts: sums per-rank counts over the global batch; returns its argument itself
            on one process (then the losses are the local means).
        step_counts: optional (E + 1,) int64 counts of the whole step (they replace this
            call's and no collective runs).

    Returns:
        A :class:`LossCounts`.
    """
    counts_E = selected_counts(routing, mask_T)
    stats = torch.cat([counts_E, counts_E.new_ones(1)])
    global_stats = global_counts(stats) if step_counts is None else step_counts
    if global_stats is stats:  # one share: the plain local means
        return LossCounts(global_stats)
    global_counts_E, shares = global_stats[:-1], global_stats[-1]
    return LossCounts(global_stats, global_counts_E,
                      global_counts_E.sum() / (routing.top_k * shares))


def aux_losses(logits_TE: torch.Tensor, scores_TE: torch.Tensor, selected_TK: torch.Tensor,
               mask_T: torch.Tensor | None, seq_len: int | None,
               counts_E: torch.Tensor | None, tokens_per_rank: torch.Tensor | None
               ) -> AuxLosses:
    """Load-balancing, z and (``seq_len`` not None) sequence-wise losses of one routing.

    Args:
        logits_TE: (T, E) fp32 router logits.
        scores_TE: (T, E) fp32 router scores (the sequence-wise loss reads them).
        selected_TK: (T, k) int64 selection before capacity drops.
        mask_T: (T,) bool valid tokens, or None.
        seq_len: tokens per sequence for the sequence-wise loss; None: not computed.
        counts_E: (E,) int64 global selection counts, or None (as :class:`LossCounts`).
        tokens_per_rank: 0-dim divisor, or None (as :class:`LossCounts`).

    Returns:
        :class:`AuxLosses` (differentiable w.r.t. the logits and scores).
    """
    seq = None  # not computed (no allocation) without a sequence length
    if seq_len is not None:
        seq = sequence_balance_loss(scores_TE, selected_TK, seq_len, mask_T)
    # z first: the load-balancing loss's nodes are then newer, so a backward runs them first and
    # frees the wrapped scalar E that its last product keeps before the z-loss's (T, E) terms
    z = z_loss(logits_TE, mask_T, tokens_per_rank=tokens_per_rank)
    return AuxLosses(load_balancing_loss(logits_TE, selected_TK, mask_T, counts_E=counts_E,
                                         tokens_per_rank=tokens_per_rank), z, seq)


@dataclass(slots=True)
class _Call:
    """One node call's arguments that are not tensors of the graph, and its side results."""

    router: TopKRouter
    mask_T: torch.Tensor | None
    seq_len: int | None
    global_counts: CountsFn
    step_counts: torch.Tensor | None
    replay: RoutingResult | None
    routing: RoutingResult | None = None


@dataclass(frozen=True, slots=True)
class _Spec:
    """What backward's recompute needs besides the saved tensors (host values only)."""

    top_k: int
    score_func: Any
    renormalize: bool
    options: RouteOptions
    seq_len: int | None


def _recompute(spec: _Spec, x_TD: torch.Tensor, weight: torch.Tensor,
               replay: RoutingResult, mask_T: torch.Tensor | None,
               counts_E: torch.Tensor | None, tokens_per_rank: torch.Tensor | None
               ) -> list[torch.Tensor]:
    """The differentiable outputs again: weights, losses (the forward's selection and counts)."""
    dtype = router_dtype(x_TD.dtype)
    routing = route(F.linear(x_TD.to(dtype), weight.to(dtype)), spec.top_k,
                    score_func=spec.score_func, renormalize=spec.renormalize,
                    valid_mask_T=mask_T, out_dtype=x_TD.dtype, options=spec.options,
                    replay=replay)
    losses = aux_losses(routing.logits, routing.scores, routing.selected_index, mask_T,
                        spec.seq_len, counts_E, tokens_per_rank)
    return [routing.top_k_weights, losses.load_balancing, losses.z,
            *(() if losses.sequence is None else (losses.sequence,))]


class RouterNode(torch.autograd.Function):
    """Router + aux losses in one node; backward recomputes the logits (module docstring).

    Inputs: x_TD (T, d) and the router weight (E, d), any float dtype, and a :class:`_Call`.
    Outputs: the (T, k) routing weights in x's dtype, then the 0-dim fp32 load-balancing and z
    losses and, when computed, the sequence-wise loss; the call receives the
    :class:`RoutingResult` (its logits and scores without a graph) and the loss counts.

    Saved for backward: x_TD, the weight, the (T, k) int64 selection (and the index after
    capacity/padding when it differs), the mask and, under several shares, the (E,) global
    counts and the 0-dim divisor; the routing replay's record is held by the node. No (T, E)
    tensor. Backward: the recompute's graph (what the plain graph saved) lives only inside it.
    """

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, weight: torch.Tensor,
                call: _Call) -> tuple[torch.Tensor, ...]:
        """Route and compute the losses without a graph; save x, W and the selection."""
        router = call.router
        routing = router.decide(x_TD, call.mask_T, call.replay)
        counts = loss_counts(routing, call.mask_T, call.global_counts, call.step_counts)
        losses = aux_losses(routing.logits, routing.scores, routing.selected_index, call.mask_T,
                            call.seq_len, counts.counts_E, counts.tokens_per_rank)
        if call.replay is None:  # a recompute's node replays; it records nothing
            ctx.record = router.replay.keep(routing)  # freed with this node
        masked = routing.top_k_index is not routing.selected_index
        ctx.save_for_backward(x_TD, weight, routing.selected_index,
                              routing.top_k_index if masked else None, call.mask_T,
                              counts.counts_E, counts.tokens_per_rank)
        ctx.spec = _Spec(router.top_k, router.score_func, router.renormalize, router.options,
                         call.seq_len)
        ctx.set_materialize_grads(False)
        call.routing = routing
        return (routing.top_k_weights, losses.load_balancing, losses.z,
                *(() if losses.sequence is None else (losses.sequence,)))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Recompute the differentiable part from x and W, differentiate it (grads of x, W)."""
        x_TD, weight, selected, masked, mask_T, counts_E, tokens_per_rank = ctx.saved_tensors
        # A recompute of this forward (a user's checkpoint) has replayed it while unpacking:
        # the record goes with the saved tensors, though the losses may keep this node alive.
        ctx.record = None
        need_x, need_w = ctx.needs_input_grad[:2]
        if not (need_x or need_w) or all(g is None for g in grads):
            return None, None, None
        empty = selected.new_zeros(0)
        replay = RoutingResult(top_k_index=selected if masked is None else masked,
                               top_k_weights=empty, logits=empty, scores=empty,
                               tokens_per_expert=empty, selected_index=selected)
        with torch.enable_grad(), torch.autocast(x_TD.device.type, enabled=False):
            x = x_TD.detach().requires_grad_(need_x)
            w = weight.detach().requires_grad_(need_w)
            outputs = _recompute(ctx.spec, x, w, replay, mask_T, counts_E, tokens_per_rank)
            used = [i for i, g in enumerate(grads) if g is not None]
            inputs = [t for t, need in ((x, need_x), (w, need_w)) if need]
            got = list(torch.autograd.grad([outputs[i] for i in used], inputs,
                                           [grads[i] for i in used], allow_unused=True))
        return (got.pop(0) if need_x else None), (got.pop(0) if need_w else None), None


def node_applies(router: TopKRouter) -> bool:
    """True when :func:`route_with_losses` runs the one node: an eager training forward.

    A :class:`TopKRouter`, grad mode on, not traced by ``torch.compile`` and no input jitter in
    training; elsewhere the router and losses stay a plain graph (or none).
    """
    return (isinstance(router, TopKRouter) and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not (router.training and router.jitter_eps > 0))


def route_with_losses(router: TopKRouter, x_TD: torch.Tensor, mask_T: torch.Tensor | None,
                      seq_len: int | None, global_counts: CountsFn,
                      step_counts: torch.Tensor | None = None
                      ) -> tuple[RoutingResult, AuxLosses]:
    """Route T tokens and compute the aux losses through one :class:`RouterNode`.

    Args:
        router: the layer's :class:`TopKRouter` (``node_applies(router)`` must hold).
        x_TD: (T, d) activations, any float dtype.
        mask_T: (T,) bool valid tokens, or None.
        seq_len: tokens per sequence of the sequence-wise loss; None: not computed.
        global_counts: sums per-rank counts over the global batch (as :func:`loss_counts`).
        step_counts: optional (E + 1,) int64 counts of the whole step (as :func:`loss_counts`).

    Returns:
        ``(routing, losses)``: ``routing.top_k_weights`` and the losses carry the node's
        gradient; ``routing.logits``/``scores`` have no graph.

    Raises:
        RuntimeError: inside a backward pass with no recorded forward decision
            (:meth:`memfine.routing.replay.RoutingReplay.take`).
    """
    replay = router.replay.take(x_TD.shape[0]) if in_backward() else None
    call = _Call(router, mask_T, seq_len, global_counts, step_counts, replay)
    outs = RouterNode.apply(x_TD, router.weight, call)
    assert call.routing is not None, "set by forward"
    routing = dataclasses.replace(call.routing, top_k_weights=outs[0])
    return routing, AuxLosses(*outs[1:])
