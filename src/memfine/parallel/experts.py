"""Routed experts sharded over an expert-parallel (EP) group, with MemFine's token chunks.

Legend: T tokens, K top-k slots, E experts (global), L experts on this rank (E/e), P ranks of the
EP group (e), M routed rows this rank sends (≤ T·k), S rows this rank's experts receive (s″),
D = d, N = n, G = 2n (gated) or n.

One layer call:
1. notify: exchange per-expert counts for each chunk of every candidate chunk count
   (:func:`exchange_counts`, one all-to-all of ints);
2. choose c from the received rows s″ (an injected policy, e.g. MACT) and agree on the maximum
   over the EP group (:func:`agree_num_chunks`), so every rank runs the same number of chunks;
3. per chunk (under non-reentrant checkpointing unless recompute is ``none``): gather the chunk's
   routed rows and their routing weights, all-to-all them to the ranks holding their experts
   (uneven, possibly zero split sizes), run the local experts with memfine's fused path, all-to-all
   the weighted rows back and sum them per token through ``token_index_map`` (deterministic);
4. concatenate the chunks.
Recompute reuses the frozen per-chunk plans (routing index, split sizes) built before the loop:
it re-issues the chunk's all-to-alls with the same shapes, never re-routes, never re-exchanges
counts.
Reference: MemFine §4 (arXiv 2511.21431); MoEBlaze §4-§5; docs/design.md §4.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfine.config import ChunkConfig, MoEConfig, Recompute
from memfine.ops import run_experts
from memfine.parallel.collectives import agree_num_chunks, all_to_all
from memfine.parallel.groups import ParallelContext, check_expert_sharding
from memfine.parallel.notify import ChunkDispatch, exchange_counts, plan_chunks
from memfine.parallel.rows import combine_returned_rows, dispatch_rows

RECOMPUTE_MODES: tuple[str, ...] = ("none", "experts", "full")


class ChunkPolicyLike(Protocol):
    """What the EP layer needs of a chunk policy (``memfine.schedule.policy.ChunkPolicy``).

    ``num_chunks(recv_rows, num_tokens, dtype_bytes)`` returns c for s″ received rows (the policy
    is expected to agree on c over the EP group through its ``agree_num_chunks``); ``budgeted``
    tells whether c depends on s″; ``config`` holds ``num_chunks``, ``bins`` and ``recompute``.
    """

    config: ChunkConfig

    @property
    def budgeted(self) -> bool:  # noqa: D102
        ...

    def num_chunks(self, recv_rows: int, num_tokens: int, dtype_bytes: int) -> int:  # noqa: D102
        ...


def ep_chunk_forward(x_TD: torch.Tensor, top_k_weights: torch.Tensor, w_up_LDG: torch.Tensor,
                     w_down_LND: torch.Tensor, plan: ChunkDispatch, context: ParallelContext,
                     config: MoEConfig) -> torch.Tensor:
    """Dispatch → local experts → combine for one chunk of tokens.

    Args:
        x_TD: (T_c, d) the chunk's activations.
        top_k_weights: (T_c, k) routing weights.
        w_up_LDG: (L, d, G) this rank's up-projections.
        w_down_LND: (L, n, d) this rank's down-projections.
        plan: the chunk's frozen :class:`ChunkDispatch`.
        context: EP group of this rank.
        config: the layer's :class:`MoEConfig` (activation, experts_impl, gemm_backend).

    Returns:
        (T_c, d) combined output in x's dtype.

    Side effects: three all-to-alls on the EP group (rows and their routing weights out, weighted
    rows back) and their inverses in backward. Every rank of the group calls this for the same
    chunk, with the same ``requires_grad`` on x and the weights.

    Memory (saved for backward when not recomputed): the received rows S·d·D_t and weights
    S·D_t, the fused path's H (S·G·D_t) and int32 indices; the sent copy (M·d) and the returned
    rows (M·d) are not saved.
    """
    send, recv = plan.send_index, plan.recv_index
    group = context.ep_group
    x_MD = dispatch_rows(x_TD, send.expert_token_indices, send.token_index_map)
    w_M = top_k_weights.reshape(-1).index_select(0, send.expert_slot_indices.long())
    x_SD = all_to_all(x_MD, plan.recv_splits, plan.send_splits, group)
    w_S1 = all_to_all(w_M, plan.recv_splits, plan.send_splits, group)[:, None]
    del x_MD, w_M  # NOTE(memory): the sent copies are transient (M·d·D_t bytes not kept)
    # Weights are applied on the expert side: the fused path saves only x_SD and H, and its
    # weight gradient ⟨dO·w_downᵀ, A⟩ needs no saved expert output (MoEBlaze §5).
    y_SD = run_experts(x_SD, w_S1, recv, w_up_LDG, w_down_LND, activation=config.activation,
                       impl=config.experts_impl, backend=config.gemm_backend)
    y_MD = all_to_all(y_SD, plan.send_splits, plan.recv_splits, group)
    return combine_returned_rows(y_MD, send.expert_token_indices, send.token_index_map)


class ExpertParallelExperts(nn.Module):
    """This rank's L = E/e experts, run on the tokens routed to them from the whole EP group.

    Parameters keep the names and layout of :class:`memfine.nn.GroupedExperts` (``w_up`` (L, d, G),
    ``w_down`` (L, n, d)) and hold global experts ``context.local_experts(E)``; each carries the
    attribute ``expert_parallel = True`` (gradient reduction and checkpoints look for it).

    Args:
        config: the layer's :class:`MoEConfig` (E global).
        context: this rank's :class:`ParallelContext`.

    Raises:
        ValueError: if E is not divisible by e.
    """

    def __init__(self, config: MoEConfig, context: ParallelContext) -> None:
        """Allocate this rank's zero-filled weights; arguments and exceptions as on the class."""
        super().__init__()
        check_expert_sharding(config.num_experts, context.ep_size)
        self.config, self.context = config, context
        L = config.num_experts // context.ep_size
        self.w_up = nn.Parameter(torch.zeros(L, config.hidden_size, config.up_width))
        self.w_down = nn.Parameter(torch.zeros(L, config.intermediate_size, config.hidden_size))
        for p in (self.w_up, self.w_down):
            p.expert_parallel = True  # type: ignore[attr-defined]

    @classmethod
    def from_full(cls, w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, config: MoEConfig,
                  context: ParallelContext) -> ExpertParallelExperts:
        """Build from the full (E, d, G) / (E, n, d) weights, keeping this rank's slice (a copy)."""
        module = cls(config, context).to(device=w_up_EDG.device, dtype=w_up_EDG.dtype)
        local = context.local_experts(config.num_experts)
        with torch.no_grad():
            module.w_up.copy_(w_up_EDG[local.start:local.stop])
            module.w_down.copy_(w_down_END[local.start:local.stop])
        return module

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            *, policy: ChunkPolicyLike | None = None, num_chunks: int = 1,
            recompute: Recompute = "none") -> tuple[torch.Tensor, int]:
        """Run the EP experts on this rank's routed tokens; returns ``(out_TD, num_chunks)``.

        Steps: notify (counts of every candidate chunk count) → c from the policy on s″, agreed
        (MAX) over the EP group → frozen per-chunk plans → chunk loop → concatenate.

        Args:
            x_TD: (T, d) activations of this rank (T may differ between ranks, may be 0).
            top_k_index: (T, k) int64 global expert ids; ids ≥ E are sentinels (never sent).
            top_k_weights: (T, k) routing weights.
            policy: decides c from s″ (its ``config.recompute`` then replaces ``recompute``);
                without one, c = ``num_chunks``, which must be equal on every rank.
            num_chunks: fixed c ≥ 1 when no policy is given.
            recompute: ``none`` (no checkpointing) or ``experts``/``full`` (checkpoint every
                chunk; ``full`` additionally concerns the transformer block, not this module).

        Returns:
            (T, d) output equal to the single-process experts on these tokens, and the c used.

        Raises:
            ValueError: on shape mismatches, an unknown recompute mode, a chunk count that
                differs between ranks, or from the policy (budget cannot be met).

        Side effects: collectives on the EP group (notify, agreement, per-chunk all-to-alls);
        every rank of the group calls it for the same layer, in the same order.

        Memory: with recompute ``experts``/``full``, a chunk keeps only its inputs (views of x
        and the weights) and its int32 plan; backward recomputes (re-issuing the chunk's
        all-to-alls with the plan's split sizes, no new count exchange) and back-propagates one
        chunk at a time, so the expert-side peak is one chunk's received rows. With ``none``, as
        :func:`ep_chunk_forward` for every chunk.
        """
        D = self.config.hidden_size
        if (x_TD.dim() != 2 or x_TD.shape[1] != D or top_k_index.dim() != 2
                or top_k_index.shape[0] != x_TD.shape[0]
                or top_k_weights.shape != top_k_index.shape):
            raise ValueError(f"expected hidden_states (T, d={D}), top_k_index and top_k_weights "
                             f"(T, k); got {tuple(x_TD.shape)}, {tuple(top_k_index.shape)}, "
                             f"{tuple(top_k_weights.shape)}")
        if policy is not None:
            recompute = policy.config.resolved_recompute
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        E, group = self.config.num_experts, self.context.ep_group
        if policy is not None and policy.budgeted:
            counts = exchange_counts(top_k_index, E, policy.config.bins, group)
            # The received rows of x (one d-row per received row) stay alive beside the experts'
            # own per-row bytes; the single-device memory model does not see them.
            policy.transport_row_elements = self.config.hidden_size
            local = policy.num_chunks(counts.recv_tokens, x_TD.shape[0], x_TD.element_size())
            num_chunks = agree_num_chunks(local, group)  # no-op when the policy already agreed
            if num_chunks not in counts.candidates:  # a policy outside its bins: notify again
                counts = exchange_counts(top_k_index, E, (num_chunks,), group)
        else:
            if policy is not None:
                num_chunks = policy.config.num_chunks
            agree_num_chunks(num_chunks, group, require_equal=True)
            counts = exchange_counts(top_k_index, E, (num_chunks,), group)
        outs = []
        for plan in plan_chunks(top_k_index, counts, num_chunks, self.config.index_builder):
            args = (x_TD[plan.start:plan.stop], top_k_weights[plan.start:plan.stop],
                    self.w_up, self.w_down, plan, self.context, self.config)
            if recompute == "none":
                outs.append(ep_chunk_forward(*args))
            else:
                # NOTE(memory): only the chunk's inputs are kept; its S_c·(d + G + 1)·D_t saved
                # bytes are recomputed in backward.
                outs.append(checkpoint(ep_chunk_forward, *args, use_reentrant=False,
                                       preserve_rng_state=False))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)), num_chunks

    def forward(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, num_chunks: int = 1,
                recompute: Recompute = "none") -> torch.Tensor:
        """Drop-in for :meth:`memfine.nn.GroupedExperts.forward`: c given, equal on every rank.

        See :meth:`run` for arguments, errors, collectives and memory.
        """
        return self.run(x_TD, top_k_index, top_k_weights, num_chunks=num_chunks,
                        recompute=recompute)[0]
