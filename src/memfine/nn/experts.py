"""The module that owns the routed expert weights.

Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n (gated) or n.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memfine.config import MoEConfig, Recompute
from memfine.schedule.chunked import chunked_experts


class GroupedExperts(nn.Module):
    """E routed experts with weights ``w_up (E, d, G)`` and ``w_down (E, n, d)``.

    Args:
        config: the layer's :class:`MoEConfig` (activation, impl, backend, index builder).
        init_std: std of the normal init of w_up; w_down uses ``init_std / sqrt(2·depth)``.
        depth: number of residual blocks (scales the output projection init, GPT-2 style).
    """

    def __init__(self, config: MoEConfig, *, init_std: float = 0.02, depth: int = 1) -> None:
        """Allocate ``w_up``/``w_down`` and initialise them; arguments as on the class."""
        super().__init__()
        self.config = config
        E, D, N = config.num_experts, config.hidden_size, config.intermediate_size
        self.w_up = nn.Parameter(torch.empty(E, D, config.up_width))
        self.w_down = nn.Parameter(torch.empty(E, N, D))
        self.init_std, self.depth = init_std, depth
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init: w_up N(0, σ²), w_down N(0, (σ/√(2·depth))²)."""
        nn.init.normal_(self.w_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.init_std / math.sqrt(2 * self.depth))

    def forward(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, num_chunks: int = 1,
                recompute: Recompute = "none") -> torch.Tensor:
        """Run the experts on T tokens already routed, in c token chunks.

        Args:
            x_TD: (T, d) activations.
            top_k_index: (T, k) int64 expert ids (sentinels ≥ E contribute zero).
            top_k_weights: (T, k) routing weights.
            num_chunks: c ≥ 1 contiguous token chunks (c > T allowed).
            recompute: ``none``, or ``experts``/``full`` to checkpoint every chunk.

        Returns:
            (T, d) combined expert output.

        Memory: c = 1 with ``none`` is the plain call of :class:`memfine.ops.FusedExpertsFunction`
        (``fused``) or :func:`memfine.ops.experts_plain` (``plain``); otherwise see
        :func:`memfine.schedule.chunked.chunked_experts`.
        """
        return chunked_experts(x_TD, top_k_index, top_k_weights, self.w_up, self.w_down,
                               moe=self.config, num_chunks=num_chunks, recompute=recompute)
