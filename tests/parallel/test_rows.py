"""The row-moving Functions of expert parallelism: gradcheck and exact values (one process)."""

from __future__ import annotations

import torch

from memfine.dispatch import build_routing_index
from memfine.parallel import combine_returned_rows, dispatch_rows


def _index(T: int = 5, E: int = 4, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    idx_TK = torch.rand(T, E).argsort(dim=1)[:, :k]
    idx_TK[1] = E  # a padding token: sentinel slots get no row
    index = build_routing_index(idx_TK, E)
    return index.expert_token_indices, index.token_index_map


def test_dispatch_rows_gathers_and_reduces_per_token() -> None:
    rows_M, map_TK = _index()
    x_TD = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    out_MD = dispatch_rows(x_TD, rows_M, map_TK)
    torch.testing.assert_close(out_MD, x_TD[rows_M.long()], atol=0, rtol=0)
    assert torch.autograd.gradcheck(lambda x: dispatch_rows(x, rows_M, map_TK), (x_TD,))


def test_combine_returned_rows_sums_per_token_and_keeps_empty_graphs() -> None:
    rows_M, map_TK = _index()
    y_MD = torch.randn(rows_M.numel(), 3, dtype=torch.float64, requires_grad=True)
    out_TD = combine_returned_rows(y_MD, rows_M, map_TK)
    want_TD = torch.zeros(5, 3, dtype=torch.float64).index_add(0, rows_M.long(), y_MD)
    torch.testing.assert_close(out_TD, want_TD, atol=0, rtol=0)
    assert torch.autograd.gradcheck(lambda y: combine_returned_rows(y, rows_M, map_TK), (y_MD,))
    # a rank that sent no rows still reaches the rows in backward (the inverse all-to-all runs)
    empty_MD = torch.zeros(0, 3, requires_grad=True)
    out_TD = combine_returned_rows(empty_MD, rows_M[:0], torch.full((2, 2), -1, dtype=torch.int32))
    assert out_TD.grad_fn is not None
    out_TD.sum().backward()
    assert empty_MD.grad is not None and empty_MD.grad.shape == (0, 3)
