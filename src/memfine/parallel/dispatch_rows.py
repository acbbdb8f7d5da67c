"""Gather token rows into expert-grouped order, with a deterministic per-token backward.

Legend: T tokens, K top-k slots, M routed rows of this rank (≤ T·k), D = d.
The backward of a plain ``index_select`` scatters with ``index_add`` over duplicate indices (a
token appears once per chosen expert), which uses atomics on GPU. Here the gradient is reduced per
token through ``token_index_map`` instead: a gather + sum over the k slots, bitwise reproducible.
Reference: MoEBlaze §4 (combine through token_index_map); DESIGN.md §3.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.ops.combine import gather_rows, reduce_rows


class DispatchRowsFunction(torch.autograd.Function):
    """forward(x_TD, expert_token_indices_M, token_index_map_TK) → x_MD = x[expert_token_indices].

    Saved for backward: the two int32 index arrays (4·(M + T·k) bytes); not x.
    Recomputed in backward: nothing. Backward transient: a (T, k, d) per-token gather.
    """

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, expert_token_indices_M: torch.Tensor,
                token_index_map_TK: torch.Tensor) -> torch.Tensor:
        # NOTE(memory): only int32 indices are saved (x is not: saves T·d·D_t bytes).
        ctx.save_for_backward(token_index_map_TK)
        ctx.mark_non_differentiable(expert_token_indices_M, token_index_map_TK)
        return gather_rows(x_TD, expert_token_indices_M)

    @staticmethod
    def backward(ctx: Any, grad_x_MD: torch.Tensor) -> tuple[Any, ...]:
        (token_index_map_TK,) = ctx.saved_tensors
        grad_x_TD = None
        if ctx.needs_input_grad[0]:
            grad_x_TD = reduce_rows(grad_x_MD.contiguous(), token_index_map_TK)
        # None: expert_token_indices, token_index_map
        return grad_x_TD, None, None


def dispatch_rows(x_TD: torch.Tensor, expert_token_indices_M: torch.Tensor,
                  token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x[expert_token_indices]`` whose backward is a per-token reduction.

    Args:
        x_TD: (T, d) float rows.
        expert_token_indices_M: (M,) int32 token of each routed row (a RoutingIndex field).
        token_index_map_TK: (T, k) int32 row of each slot, -1 for sentinel slots.

    Returns:
        (M, d) new tensor.
    """
    out: torch.Tensor = DispatchRowsFunction.apply(x_TD, expert_token_indices_M,
                                                   token_index_map_TK)
    return out
