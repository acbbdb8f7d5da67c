"""The MoE feed-forward layer: router → routing index → experts → combine.

Legend: T tokens, K top-k slots, E experts, D = d.
Reference: DESIGN.md §2-§4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memfine.config import MoEConfig
from memfine.nn.experts import GroupedExperts
from memfine.routing import TopKRouter, load_balancing_loss, z_loss


@dataclass(frozen=True, slots=True)
class MoEAux:
    """Side outputs of one MoE layer call (computed once, outside any recompute).

    Attributes:
        load_balancing_loss: 0-dim fp32 Switch loss (1.0 when balanced).
        z_loss: 0-dim fp32 router z-loss.
        tokens_per_expert: (E,) int64 assignments per expert this call.
        num_chunks: chunk count c used for the expert part (1 when unchunked).
    """

    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_chunks: int = 1


class MoELayer(nn.Module):
    """Router + routed experts.

    Steps: (1) flatten x to (T, d) and zero padding rows by selection; (2) route once in fp32;
    (3) run the experts on the routing result; (4) return the output and :class:`MoEAux`
    (losses are returned, never added silently).

    Args:
        config: :class:`MoEConfig`.
        depth: number of residual blocks of the model (output-projection init scale).
    """

    def __init__(self, config: MoEConfig, *, depth: int = 1) -> None:
        super().__init__()
        self.config = config
        self.router = TopKRouter(config.hidden_size, config.num_experts, config.top_k,
                                 score_func=config.score_func, renormalize=config.renormalize)
        self.experts = GroupedExperts(config, depth=depth)

    def run_experts(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Expert part on routed tokens; returns (out_TD, num_chunks). Overridable schedule hook."""
        return self.experts(x_TD, top_k_index, top_k_weights), 1

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
        aux = MoEAux(
            load_balancing_loss=load_balancing_loss(routing.logits, routing.top_k_index, mask_T),
            z_loss=z_loss(routing.logits, mask_T),
            tokens_per_expert=routing.tokens_per_expert,
            num_chunks=num_chunks,
        )
        return out_TD.view(x.shape), aux
