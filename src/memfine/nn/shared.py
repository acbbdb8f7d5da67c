"""Shared (always-on) experts of an MoE layer, run on memfine's fused, chunked expert path.

Legend: T tokens, K slots (here k = S, the number of shared experts), D = d, G = 2n_s or n_s.

Every token goes to all S shared experts (DeepSeek-MoE / DeepSeek-V3 shared experts; Qwen2-MoE's
shared expert with its sigmoid gate). They run as a routed layer whose routing is fixed:
``top_k_index = [0, 1, ..., S-1]`` for every token and weight 1 (or the gate). So the fused
Function, the chunking and the recompute mode of the routed experts apply to them unchanged:
fused saves x and H only, and chunked recompute keeps only the layer input.

Reference: DeepSeek-V3 (arXiv 2412.19437) §2.1.2 (shared experts); Qwen2-MoE
(``shared_expert_gate``); MoEBlaze §4 (fused path); MemFine §4 (chunking).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfine.config import MoEConfig, Recompute
from memfine.nn.experts import GroupedExperts


class SharedExperts(nn.Module):
    """S shared experts applied to every token, optionally scaled by sigmoid(x·w_g).

    Args:
        moe: the layer's :class:`MoEConfig` (``num_shared_experts``,
            ``shared_intermediate_size``, ``shared_expert_gate``).
        depth: residual blocks of the model (output-projection init scale).

    Attributes:
        experts: :class:`GroupedExperts` with weights ``w_up (S, d, G)``, ``w_down (S, n_s, d)``.
        gate: (1, d) parameter of the sigmoid gate, or None.
    """

    def __init__(self, moe: MoEConfig, *, depth: int = 1) -> None:
        """Build the experts (and gate, initialised N(0, 0.02²)); arguments as on the class."""
        super().__init__()
        self.config = moe.shared_experts_config()
        self.experts = GroupedExperts(self.config, depth=depth)
        self.gate = (nn.Parameter(torch.randn(1, moe.hidden_size) * 0.02)
                     if moe.shared_expert_gate else None)

    def forward(self, x_TD: torch.Tensor, valid_mask_T: torch.Tensor | None = None, *,
                num_chunks: int = 1, recompute: Recompute = "none",
                block_rows: int | None = None) -> torch.Tensor:
        """Σ_s g_t·Expert_s(x_t) for every token t.

        Args:
            x_TD: (T, d) activations (padding rows already zeroed).
            valid_mask_T: optional (T,) bool; padding tokens get sentinel slots (no rows).
            num_chunks: c, as for the routed experts.
            recompute: ``none``, ``experts`` or ``full``, as for the routed experts.
            block_rows: the fused path's rows per row block (the layer's
                :func:`memfine.config.shared_block_rows`; None: the config's own).

        Returns:
            (T, d) in x's dtype.

        Memory: as the routed experts with k = S and n = n_s (fused: H of T·S rows, S·T·G·D_t
        bytes, the int32 index arrays and the (T, S) weights; recompute: only the inputs). The
        index is an expanded (S,) arange (S·8 bytes); the weights are a (T, S) tensor of ones, or
        the gate's (T, 1) sigmoid expanded.
        """
        T, S = x_TD.shape[0], self.config.num_experts
        index_TK = torch.arange(S, device=x_TD.device).expand(T, S)
        if valid_mask_T is not None:
            index_TK = torch.where(valid_mask_T[:, None], index_TK, S)
        if self.gate is None:
            weights_TK = x_TD.new_ones(T, S)
        else:
            weights_TK = F.linear(x_TD, self.gate.to(x_TD.dtype)).sigmoid().expand(T, S)
        return self.experts(x_TD, index_TK, weights_TK, num_chunks=num_chunks,
                            recompute=recompute, block_rows=block_rows)
