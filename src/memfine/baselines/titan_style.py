"""torchtitan's experts behind memfine's router: a torchtitan-style recipe, and torchtitan's own.

The experts part follows torchtitan's ``TokenReorderer`` + ``GroupedExperts``
(``torchtitan/models/common/moe.py``): expert counts with ``histc`` and a stable ``argsort`` of the
expert ids (no host sync), a gathered copy of x in expert order, ``torch._grouped_mm`` for the up-
and down-projections under autograd, the routing weights applied to the expert outputs, and an
``index_add_`` (torchtitan: ``scatter_add_``) back to token order. Router, load-balancing loss
and z-loss are :class:`memfine.nn.MoELayer`'s, so the layer computes the same aux losses as
memfine's (:func:`titan_style_layer`); the ``counts`` suite compares op counts against it.

:func:`torchtitan_layer` runs torchtitan's own ``RoutedExperts`` (``LocalTokenDispatcher`` +
``GroupedExperts``, torchtitan 0.3) instead, on views of the same weights and memfine's routing
(same top-k ids and weights): w1 = the gate half of ``w_up``, w3 = its up half, w2 = ``w_down``,
each transposed to torchtitan's (E, out, in) layout. torchtitan's ``GroupedExperts`` computes in
bf16 whatever the weights' dtype (its ``x.bfloat16()`` casts) and scores the expert outputs in
fp32 before its deterministic scatter-add. Needs torchtitan (``memfine[torchtitan]``);
:func:`torchtitan_missing` says why it cannot run.

Memory: autograd saves the gathered x (S·d), H (S·G), the activation's inputs and the expert
output (S·d), as torchtitan does without activation checkpointing.
Legend: T tokens, K top-k slots, M = T·K (token, slot) pairs, E experts, D = d, G = 2n.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from memfine.activations import apply_activation
from memfine.baselines.layers import sharing
from memfine.config import MoEConfig
from memfine.nn import GroupedExperts, MoELayer
from memfine.schedule.policy import ChunkPlan, ChunkPolicy


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
            policy: ChunkPolicy) -> tuple[torch.Tensor, ChunkPlan]:
        """Torchtitan's recipe on this module's weights and activation."""
        out_TD = titan_experts(x_TD, top_k_index, top_k_weights, self.w_up, self.w_down,
                               activation=self.config.activation)
        return out_TD, ChunkPlan(1)


def titan_style_layer(base: MoELayer, moe: MoEConfig) -> MoELayer:
    """A layer sharing ``base``'s parameters whose experts run :func:`titan_experts`.

    The experts module keeps its parameters and only changes class (it adds no state).
    """
    layer = sharing(base, moe)
    layer.experts.__class__ = TitanStyleExperts
    return layer


def torchtitan_missing() -> str | None:
    """None when torchtitan's experts can run here, else why not (one line)."""
    from memfine.integrations.torchtitan import require_torchtitan

    try:
        require_torchtitan()
    except ImportError as err:
        return str(err)
    return None


@functools.lru_cache(maxsize=8)
def _routed_experts(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int
                    ) -> nn.Module:
    """Torchtitan's ``RoutedExperts`` of these sizes on the meta device (weights come per call)."""
    from torchtitan.models.common.moe import GroupedExperts as TitanGroupedExperts
    from torchtitan.models.common.moe import RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    config = RoutedExperts.Config(
        inner_experts=TitanGroupedExperts.Config(dim=hidden_size, hidden_dim=intermediate_size,
                                                 num_experts=num_experts),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
    with torch.device("meta"):
        module: nn.Module = config.build()
    return module


class TorchtitanExperts(GroupedExperts):
    """Routed experts computed by torchtitan's own ``RoutedExperts`` on this module's weights."""

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, ChunkPlan]:
        """Torchtitan's dispatch → ``GroupedExperts`` → combine; one chunk (no policy asked).

        The expert counts are torchtitan ``MoE.forward``'s (a (T, E) one-hot routing map summed
        over tokens); the weights are views, so gradients reach this module's parameters.

        Raises:
            ValueError: for an activation other than ``swiglu`` (torchtitan's experts are SiLU
                gated).
        """
        config = self.config
        if config.activation != "swiglu":
            raise ValueError("torchtitan's GroupedExperts computes swiglu, got activation="
                             f"{config.activation!r}")
        T, D = x_TD.shape
        E, K, N = config.num_experts, top_k_index.shape[1], config.intermediate_size
        gate_EDN, up_EDN = self.w_up.split(N, dim=-1)
        params = {"inner_experts.w1_EFD": gate_EDN.transpose(1, 2),
                  "inner_experts.w3_EFD": up_EDN.transpose(1, 2),
                  "inner_experts.w2_EDF": self.w_down.transpose(1, 2)}
        counts_E = torch.zeros(T, E, dtype=torch.bool, device=x_TD.device).scatter_(
            -1, top_k_index, True).sum(0)
        args: tuple[Any, ...] = (x_TD.view(1, T, D), top_k_weights.view(1, T, K),
                                 top_k_index.view(1, T, K), counts_E)
        out = torch.func.functional_call(_routed_experts(E, K, D, N), params, args)
        return out.view(T, D), ChunkPlan(1)


def torchtitan_layer(base: MoELayer, moe: MoEConfig) -> MoELayer:
    """A layer sharing ``base``'s router and weights whose experts are torchtitan's own.

    Raises:
        ImportError: when torchtitan is missing or not 0.3.x (:func:`torchtitan_missing`).
    """
    reason = torchtitan_missing()
    if reason is not None:
        raise ImportError(reason)
    layer = sharing(base, moe)
    layer.experts.__class__ = TorchtitanExperts
    return layer
