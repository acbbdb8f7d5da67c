"""Moving rows between token order and expert-grouped order, deterministically.

Legend: T tokens, K top-k slots, S routed rows, D features.
Every reduction is a per-token gather + sum over the k slots (no atomics, no index_add with
duplicate indices), so results are bitwise reproducible. Sentinel slots (token_index_map == -1)
are removed by selection: they read a zero row, never a NaN multiplied by 0.
Reference: MoEBlaze §4 (combine through token_index_map); DESIGN.md §3.
"""

from __future__ import annotations

import torch


def gather_rows(x_TD: torch.Tensor, expert_token_indices_S: torch.Tensor) -> torch.Tensor:
    """Return the (S, D) expert-grouped copy x[expert_token_indices] (a new tensor)."""
    return x_TD.index_select(0, expert_token_indices_S.long())


def _slot_rows(rows_SD: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """(T, K, D) rows of every slot; sentinel slots read an appended zero row."""
    S, D = rows_SD.shape
    valid_TK = token_index_map_TK >= 0
    padded_SD = torch.cat([rows_SD, rows_SD.new_zeros(1, D)])
    idx_TK = torch.where(valid_TK, token_index_map_TK.long(), S)
    return padded_SD.index_select(0, idx_TK.reshape(-1)).view(*idx_TK.shape, D)


def combine_rows(y_SD: torch.Tensor, weights_TK: torch.Tensor,
                 token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j w[t, j] · Y[token_index_map[t, j]] over valid slots.

    Args:
        y_SD: (S, D) expert outputs in expert-grouped order.
        weights_TK: (T, k) routing weights; entries of sentinel slots are ignored (selected out).
        token_index_map_TK: (T, k) int32 rows, -1 for sentinel slots.

    Returns:
        (T, D) new tensor in y's dtype. Differentiable (autograd through index_select).

    Memory: allocates a transient (T, k, D) gathered copy.
    """
    rows_TKD = _slot_rows(y_SD, token_index_map_TK)
    w_TK = torch.where(token_index_map_TK >= 0, weights_TK.to(y_SD.dtype), 0)
    return torch.bmm(w_TK.unsqueeze(1), rows_TKD).squeeze(1)


def reduce_rows(rows_SD: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j rows[token_index_map[t, j]] over valid slots (unweighted; used for dx).

    Returns:
        (T, D) new tensor. Memory: a transient (T, k, D) gathered copy.
    """
    return _slot_rows(rows_SD, token_index_map_TK).sum(1)


def scatter_slots(values_S: torch.Tensor, expert_slot_indices_S: torch.Tensor,
                  shape_TK: tuple[int, int]) -> torch.Tensor:
    """Put per-row values back into a (T, k) slot tensor; sentinel slots get 0.

    Every slot owns at most one row, so the write has no duplicate index (deterministic).
    """
    out_TK = values_S.new_zeros(shape_TK)
    out_TK.view(-1).index_copy_(0, expert_slot_indices_S.long(), values_S)
    return out_TK
