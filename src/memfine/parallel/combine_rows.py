"""Sum returned expert rows per token, with a backward that is a plain row gather.

Legend: T tokens, K top-k slots, M routed rows of this rank (≤ T·k), D = d.
The adjoint of :class:`~memfine.parallel.dispatch_rows.DispatchRowsFunction`: forward sums each
token's k rows through ``token_index_map`` (deterministic, no atomics); backward hands every row
its token's gradient. Unlike a composite of autograd ops it always stays in the graph, even with
M = 0 rows, so a rank that sent no rows still runs the inverse all-to-all in backward (every rank
of the EP group must join it).
Reference: MoEBlaze §4 (combine through token_index_map); DESIGN.md §3.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.ops.combine import gather_rows, reduce_rows


class CombineRowsFunction(torch.autograd.Function):
    """forward(y_MD, expert_token_indices_M, token_index_map_TK) → out_TD, out[t] = Σ_j y[map[t,j]].

    Saved for backward: ``expert_token_indices`` (int32, 4·M bytes); not y.
    Recomputed in backward: nothing. Forward transient: a (T, k, d) per-token gather.
    """

    @staticmethod
    def forward(ctx: Any, y_MD: torch.Tensor, expert_token_indices_M: torch.Tensor,
                token_index_map_TK: torch.Tensor) -> torch.Tensor:
        # NOTE(memory): only int32 indices are saved (y is not: saves M·d·D_t bytes).
        ctx.save_for_backward(expert_token_indices_M)
        ctx.mark_non_differentiable(expert_token_indices_M, token_index_map_TK)
        return reduce_rows(y_MD, token_index_map_TK)

    @staticmethod
    def backward(ctx: Any, grad_out_TD: torch.Tensor) -> tuple[Any, ...]:
        (expert_token_indices_M,) = ctx.saved_tensors
        grad_y_MD = None
        if ctx.needs_input_grad[0]:
            grad_y_MD = gather_rows(grad_out_TD.contiguous(), expert_token_indices_M)
        # None: expert_token_indices, token_index_map
        return grad_y_MD, None, None


def combine_returned_rows(y_MD: torch.Tensor, expert_token_indices_M: torch.Tensor,
                          token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """Differentiable per-token sum of the (already weighted) rows returned by the experts.

    Args:
        y_MD: (M, d) rows in this rank's expert-grouped order.
        expert_token_indices_M: (M,) int32 token of each row.
        token_index_map_TK: (T, k) int32 row of each slot, -1 for sentinel slots.

    Returns:
        (T, d) new tensor; tokens without rows get exact zeros.
    """
    out: torch.Tensor = CombineRowsFunction.apply(y_MD, expert_token_indices_M,
                                                  token_index_map_TK)
    return out
