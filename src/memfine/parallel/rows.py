"""Move rows between token order and expert-grouped order, each way the adjoint of the other.

Legend: T tokens, K top-k slots, M routed rows of this rank (≤ T·k), D = d.

- :func:`dispatch_rows` gathers token rows into expert-grouped order. The backward of a plain
  ``index_select`` scatters with ``index_add`` over duplicate indices (a token appears once per
  chosen expert), which uses atomics on GPU; here the gradient is reduced per token through
  ``token_index_map`` instead: a gather + sum over the k slots, bitwise reproducible.
- :func:`combine_returned_rows` sums the rows the experts return per token (deterministic, no
  atomics); its backward hands every row its token's gradient. Unlike a composite of autograd
  ops it always stays in the graph, even with M = 0 rows, so a rank that sent no rows still runs
  the inverse all-to-all in backward (every rank of the EP group must join it).
Reference: MoEBlaze §4 (combine through token_index_map); docs/design.md §3.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.ops.combine import gather_rows, reduce_rows


class RowsFunction(torch.autograd.Function):
    """forward(rows, expert_token_indices_M, token_index_map_TK, gather) → moved rows.

    ``gather=True``: x_TD → x_MD = x[expert_token_indices]; backward reduces per token.
    ``gather=False``: y_MD → out_TD, out[t] = Σ_j y[map[t, j]]; backward gathers per row.

    Saved for backward: the one int32 index array the backward move needs
    (``token_index_map`` 4·T·k bytes when gathering, ``expert_token_indices`` 4·M bytes when
    summing); never the rows.
    Recomputed in backward: nothing. Transient: a (T, k, d) per-token gather in the summing move.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, expert_token_indices_M: torch.Tensor,
                token_index_map_TK: torch.Tensor, gather: bool) -> torch.Tensor:
        """Apply the move chosen by ``gather``; save only the index array backward needs."""
        # NOTE(memory): only int32 indices are saved (the rows are not: saves rows·d·D_t bytes).
        ctx.gather = gather
        ctx.save_for_backward(token_index_map_TK if gather else expert_token_indices_M)
        ctx.mark_non_differentiable(expert_token_indices_M, token_index_map_TK)
        if gather:
            return gather_rows(rows, expert_token_indices_M)
        return reduce_rows(rows, token_index_map_TK)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        """Apply the other move to the gradient; None for the index arrays and ``gather``."""
        (index,) = ctx.saved_tensors
        grad_rows = None
        if ctx.needs_input_grad[0]:
            move = reduce_rows if ctx.gather else gather_rows
            grad_rows = move(grad_out.contiguous(), index)
        # None: expert_token_indices, token_index_map, gather
        return grad_rows, None, None, None


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
    out: torch.Tensor = RowsFunction.apply(x_TD, expert_token_indices_M, token_index_map_TK,
                                           True)
    return out


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
    out: torch.Tensor = RowsFunction.apply(y_MD, expert_token_indices_M, token_index_map_TK,
                                           False)
    return out
