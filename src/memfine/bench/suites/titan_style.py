"""A torchtitan-style MoE layer: memfine's router and aux losses, torchtitan's expert recipe.

The experts part follows torchtitan's ``TokenReorderer`` + ``GroupedExperts``
(``torchtitan/models/common/moe.py``): expert counts with ``histc`` and a stable ``argsort`` of the
expert ids (no host sync), a gathered copy of x in expert order, ``torch._grouped_mm`` for the up-
and down-projections under autograd, the routing weights applied to the expert outputs, and an
``index_add_`` (torchtitan: ``scatter_add_``) back to token order. Router, load-balancing loss
and z-loss are :class:`memfine.nn.MoELayer`'s, so the layer computes the same aux losses as
memfine's (:func:`titan_style_layer`); the ``counts`` suite compares op counts against it.

Memory: autograd saves the gathered x (S·d), H (S·G), the activation's inputs and the expert
output (S·d), as torchtitan does without activation checkpointing.
Legend: T tokens, K top-k slots, M = T·K (token, slot) pairs, E experts, D = d, G = 2n.
"""

from __future__ import annotations

import torch

from memfine.bench.suites.layers import sharing
from memfine.config import MoEConfig
from memfine.nn import GroupedExperts, MoELayer
from memfine.ops.activations import apply_activation
from memfine.schedule.policy import ChunkPolicy


def titan_experts(x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, activation: str = "swiglu"
                  ) -> torch.Tensor:
    """Sort by expert (histc + argsort), gather, two ``torch._grouped_mm``, weight, scatter back.

    Args:
        x_TD: the layer's (T, d) bf16 or fp32 tokens.
        top_k_index: chosen experts, (T, k) int64.
        top_k_weights: their (T, k) weights, applied in x's dtype after the down-projection.
        w_up_EDG: gate and up halves, (E, d, G), rows 16-byte aligned.
        w_down_END: the down-projection, (E, n, d).
        activation: name of the gated activation (``swiglu``).

    Returns:
        The (T, d) routed output, a new tensor.
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
    """Routed experts computed by :func:`titan_experts` (one chunk; the policy is not asked)."""

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, int]:
        """Torchtitan's recipe on this module's weights and activation."""
        out_TD = titan_experts(x_TD, top_k_index, top_k_weights, self.w_up, self.w_down,
                               activation=self.config.activation)
        return out_TD, 1


def titan_style_layer(base: MoELayer, moe: MoEConfig) -> MoELayer:
    """A layer sharing ``base``'s parameters whose experts run :func:`titan_experts`.

    The experts module keeps its parameters and only changes class (it adds no state).
    """
    layer = sharing(base, moe)
    layer.experts.__class__ = TitanStyleExperts
    return layer
