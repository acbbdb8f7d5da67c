"""The MoE feed-forward layer: router → routing index → chunked experts → combine.

Legend: T tokens, K top-k slots, E experts, D = d.
Reference: docs/design.md §2-§4; MemFine §4 (chunked scheduling, MACT).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfine.config import ChunkConfig, MoEConfig
from memfine.nn.experts import GroupedExperts
from memfine.nn.shared import SharedExperts
from memfine.routing import (
    RouteOptions,
    TopKRouter,
    load_balancing_loss,
    sequence_balance_loss,
    z_loss,
)
from memfine.routing.router import RoutingResult
from memfine.schedule.policy import ChunkPolicy

# A layer built without a chunk config runs its experts in one piece without recomputation.
NO_CHUNKING = ChunkConfig(num_chunks=1, recompute="none")


@dataclass(frozen=True, slots=True)
class MoEAux:
    """Side outputs of one MoE layer call (computed once, outside any recompute).

    Attributes:
        load_balancing_loss: 0-dim fp32 Switch loss (1.0 when balanced).
        z_loss: 0-dim fp32 router z-loss.
        tokens_per_expert: (E,) int64 assignments per expert this call (kept pairs only).
        num_chunks: chunk count c used for the expert part (1 when unchunked).
        sequence_balance_loss: 0-dim fp32 DeepSeek-V3 sequence-wise balance loss; None when
            ``seq_aux_loss_coef`` is 0 (not computed).
        dropped_pairs: 0-dim int64 (token, slot) pairs dropped by capacity; None when dropless.
    """

    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_chunks: int = 1
    sequence_balance_loss: torch.Tensor | None = None
    dropped_pairs: torch.Tensor | None = None


class MoELayer(nn.Module):
    """Router + routed experts, run in c token chunks chosen by a :class:`ChunkPolicy`.

    Steps: (1) flatten x to (T, d) and zero padding rows by selection; (2) route once in fp32
    (outside every recomputed region); (3) ask the policy for c (fixed, or MACT from the rows the
    experts receive); (4) run the experts chunk by chunk with the configured recomputation;
    (5) return the output and :class:`MoEAux` (losses are returned, never added silently).

    Args:
        config: :class:`MoEConfig`. Its experiment knobs ``skew_hot_experts``/``skew_bias`` set
            the router's ``selection_bias`` (hot experts 0..h-1) at construction.
        depth: number of residual blocks of the model (output-projection init scale).
        chunk: chunking and recompute (:class:`ChunkConfig`); default :data:`NO_CHUNKING`.
        policy: a policy shared with other layers (instead of ``chunk``); its ``moe`` must equal
            ``config``.

    Routing options of ``config`` (capacity, group limit, scaling, jitter) go to the router;
    shared experts (``num_shared_experts``) run on the same chunked path and are added to the
    routed output. The losses count the router's selection (before capacity drops).

    Raises:
        ValueError: if both ``chunk`` and ``policy`` are given, or the policy's MoE config differs.

    Attributes:
        policy: the :class:`ChunkPolicy`; under expert parallelism set its ``agree_num_chunks``.
    """

    def __init__(self, config: MoEConfig, *, depth: int = 1, chunk: ChunkConfig | None = None,
                 policy: ChunkPolicy | None = None) -> None:
        """Build the router and experts; arguments and exceptions as on the class."""
        super().__init__()
        if chunk is not None and policy is not None:
            raise ValueError("MoELayer takes chunk or policy, not both")
        if policy is not None and policy.moe != config:
            raise ValueError(f"MoELayer policy.moe must equal config, got {policy.moe} vs {config}")
        self.config = config
        self.policy = policy or ChunkPolicy(chunk or NO_CHUNKING, config)
        # Runtime hook (not config): maps this rank's (E,) assignment counts to the global
        # batch's, e.g. an all-reduce SUM under data/expert parallelism; None on one process.
        self.reduce_expert_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.router = TopKRouter(config.hidden_size, config.num_experts, config.top_k,
                                 score_func=config.score_func, renormalize=config.renormalize,
                                 options=RouteOptions.from_config(config),
                                 jitter_eps=config.router_jitter_eps)
        self.experts = GroupedExperts(config, depth=depth)
        self.shared_experts = (SharedExperts(config, depth=depth)
                               if config.num_shared_experts else None)
        if config.skew_hot_experts:
            with torch.no_grad():
                self.router.selection_bias[: config.skew_hot_experts] = config.skew_bias

    def received_rows(self, top_k_index: torch.Tensor) -> int:
        """s″: rows this layer's experts receive, i.e. (token, slot) pairs with an id in [0, E).

        Sentinel slots (padding, remote experts) are not counted. An expert-parallel layer
        overrides this (or passes its own count to the policy) with the rows from its count
        exchange. Synchronises with the device (one ``.item()``).
        """
        E = self.config.num_experts
        return int(((top_k_index >= 0) & (top_k_index < E)).sum().item())

    def run_experts(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Expert part on routed tokens; returns ``(out_TD, num_chunks)``. Overridable hook.

        Args:
            x_TD: (T, d) activations.
            top_k_index: (T, k) int64 expert ids from the router (sentinels ≥ E allowed).
            top_k_weights: (T, k) routing weights.

        Returns:
            (T, d) output and the chunk count c used.

        Raises:
            ValueError: from the policy when a budget cannot be met.

        Side effects: with a budget, one ``agree_num_chunks`` call (see :class:`ChunkPolicy`).

        Memory: see :func:`memfine.schedule.chunked.chunked_experts` for each recompute mode.
        """
        policy = self.policy
        recv = self.received_rows(top_k_index) if policy.budgeted else 0
        num_chunks = policy.num_chunks(recv, x_TD.shape[0], x_TD.element_size())
        out_TD = self.experts(x_TD, top_k_index, top_k_weights, num_chunks=num_chunks,
                              recompute=policy.config.resolved_recompute)
        return out_TD, num_chunks

    def _aux(self, routing: RoutingResult, mask_T: torch.Tensor | None, seq_len: int,
             num_chunks: int) -> MoEAux:
        """Losses and counters of one call (outside every recomputed region)."""
        global_counts_E = None
        if self.reduce_expert_counts is not None:
            global_counts_E = self.reduce_expert_counts(routing.tokens_per_expert.clone())
        seq_loss = None  # not computed (no allocation) when its coefficient is 0
        if self.config.seq_aux_loss_coef > 0:
            seq_loss = sequence_balance_loss(routing.scores, routing.selected_index, seq_len,
                                             mask_T)
        return MoEAux(
            load_balancing_loss=load_balancing_loss(routing.logits, routing.selected_index, mask_T,
                                                    counts_E=global_counts_E),
            z_loss=z_loss(routing.logits, mask_T),
            tokens_per_expert=routing.tokens_per_expert,
            num_chunks=num_chunks,
            sequence_balance_loss=seq_loss,
            dropped_pairs=routing.dropped_pairs,
        )

    def forward(self, x: torch.Tensor, valid_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MoEAux]:
        """Apply the layer.

        Args:
            x: (..., d) activations (e.g. (b, s, d)).
            valid_mask: optional bool tensor of shape x.shape[:-1]; False marks padding tokens,
                which are removed by selection (output rows exactly 0, no NaN propagation) and
                left out of counts and losses.

        Returns:
            ``(out, aux)``: out has x's shape and dtype.

        Raises:
            ValueError: if x's last dimension is not d or the mask shape does not match.
        """
        D = self.config.hidden_size
        if x.dim() < 1 or x.shape[-1] != D:
            raise ValueError(f"x must be (..., d) with d={D}, got {tuple(x.shape)}")
        x_TD = x.reshape(-1, D)
        mask_T = None
        if valid_mask is not None:
            if valid_mask.shape != x.shape[:-1] or valid_mask.dtype != torch.bool:
                raise ValueError(f"valid_mask must be bool of shape {tuple(x.shape[:-1])}, got "
                                 f"{valid_mask.dtype} {tuple(valid_mask.shape)}")
            mask_T = valid_mask.reshape(-1)
            x_TD = torch.where(mask_T[:, None], x_TD, torch.zeros((), dtype=x.dtype))
        routing = self.router(x_TD, mask_T)
        out_TD, num_chunks = self.run_experts(x_TD, routing.top_k_index, routing.top_k_weights)
        if self.shared_experts is not None:
            recompute = self.policy.config.resolved_recompute
            out_TD = out_TD + self.shared_experts(x_TD, mask_T, num_chunks=num_chunks,
                                                  recompute=recompute)
        seq_len = x.shape[-2] if x.dim() >= 3 else x_TD.shape[0]
        return out_TD.view(x.shape), self._aux(routing, mask_T, seq_len, num_chunks)
