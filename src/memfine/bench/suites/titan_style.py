"""A torchtitan-style MoE layer: memfine's router and aux losses, torchtitan's expert recipe.

The experts part follows torchtitan's ``TokenReorderer`` + ``GroupedExperts``
(``torchtitan/models/common/moe.py``): expert counts with ``histc`` and a stable ``argsort`` of the
expert ids (no host sync), a gathered copy of x in expert order, ``torch._grouped_mm`` for the up-
and down-projections under autograd, the routing weights applied to the expert outputs, and an
``index_add_`` (torchtitan: ``scatter_add_``) back to token order. Router, load-balancing loss
and z-loss are :class:`memfine.nn.MoELayer`'s, so the layer computes the same aux losses as
memfine's; the ``counts`` suite compares op counts against it.

Memory: autograd saves the gathered x (S·d), H (S·G), the activation's inputs and the expert
output (S·d), as torchtitan does without activation checkpointing.
Legend: T tokens, K top-k slots, M = T·K (token, slot) pairs, E experts, D = d, G = 2n.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.config import MoEConfig
from memfine.nn import GroupedExperts, MoELayer
from memfine.ops.activations import apply_activation
from memfine.schedule.policy import ChunkPolicy


def titan_experts(x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, activation: str = "swiglu"
                  ) -> torch.Tensor:
    """Sort by expert (histc + argsort), gather, two ``torch._grouped_mm``, weight, scatter back.

    Args:
        x_TD: (T, d) input rows (bf16 or fp32).
        top_k_index: (T, k) int64 expert of each slot.
        top_k_weights: (T, k) routing weights (cast to x's dtype).
        w_up_EDG: (E, d, G) up-projection weights.
        w_down_END: (E, n, d) down-projection weights.
        activation: the expert activation.

    Returns:
        (T, d) new tensor.
    """
    E, K = w_up_EDG.shape[0], top_k_index.shape[1]
    ids_M = top_k_index.reshape(-1)
    counts_E = torch.histc(ids_M.float(), bins=E, min=0, max=E)
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    order_M = torch.argsort(ids_M, stable=True)
    token_M = order_M // K
    h_MG = torch._grouped_mm(x_TD[token_M], w_up_EDG, offs=offs_E)
    y_MD = torch._grouped_mm(apply_activation(h_MG, activation), w_down_END, offs=offs_E)
    y_MD = y_MD * top_k_weights.reshape(-1)[order_M, None].to(y_MD.dtype)
    return torch.zeros_like(x_TD).index_add_(0, token_M, y_MD)


class TitanStyleExperts(GroupedExperts):
    """Experts run as :func:`titan_experts` (one chunk; the policy is not asked)."""

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, int]:
        """:func:`titan_experts` over the expert weights."""
        return titan_experts(x_TD, top_k_index, top_k_weights, self.w_up, self.w_down,
                             self.config.activation), 1


class TitanStyleMoELayer(MoELayer):
    """MoE layer whose experts are :class:`TitanStyleExperts` (same router and aux losses)."""

    def __init__(self, config: MoEConfig, **kwargs: Any) -> None:
        """As :class:`MoELayer`, with the torchtitan-style experts."""
        super().__init__(config, **kwargs)
        self.experts = TitanStyleExperts(config)
