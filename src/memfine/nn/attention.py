"""Multi-head causal self-attention with RoPE, the attention half of a transformer block.

Legend: B batch, Q sequence length, H heads, A head dim, D = d.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfine.config import ModelConfig


def _rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (Q, A/2) fp32 cos and sin tables for positions ``0..seq_len-1`` on ``device``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs_QA = torch.outer(torch.arange(seq_len, device=device).float(), inv)
    return freqs_QA.cos(), freqs_QA.sin()


def _apply_rope(x_BHQA: torch.Tensor, cos_QA: torch.Tensor, sin_QA: torch.Tensor
                ) -> torch.Tensor:
    x1, x2 = x_BHQA.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos_QA - x2 * sin_QA, x1 * sin_QA + x2 * cos_QA], dim=-1)
    return out.to(x_BHQA.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE (SDPA kernel)."""

    def __init__(self, config: ModelConfig) -> None:
        """Build the projections.

        Args:
            config: :class:`ModelConfig` (``moe.hidden_size`` d, ``num_heads``, ``rope_theta``).
                The RoPE cos/sin tables are computed in each forward for its own Q positions,
                (Q, d / num_heads / 2) fp32 on the input's device: nothing is allocated for
                ``max_seq_len`` positions, so a long context costs memory only when it is used.
        """
        super().__init__()
        D = config.moe.hidden_size
        self.num_heads = config.num_heads
        self.rope_theta = config.rope_theta
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x_BQD: torch.Tensor) -> torch.Tensor:
        """(B, Q, d) → (B, Q, d)."""
        B, Q, D = x_BQD.shape
        q, k, v = self.qkv(x_BQD).view(B, Q, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        cos_QA, sin_QA = _rope_tables(Q, D // self.num_heads, self.rope_theta, x_BQD.device)
        q = _apply_rope(q, cos_QA, sin_QA)
        k = _apply_rope(k, cos_QA, sin_QA)
        y_BHQA = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_BHQA.transpose(1, 2).reshape(B, Q, D))
