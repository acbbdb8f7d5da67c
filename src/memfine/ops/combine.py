"""Moving rows between token order and expert-grouped order, deterministically.

Legend: T tokens, K top-k slots, S routed rows, D features.
Every reduction is a per-token gather + sum over the k slots (no atomics, no index_add with
duplicate indices), so results are bitwise reproducible. Sentinel slots (token_index_map == -1)
are removed by selection: they read an exact zero row and a zero weight, never a NaN times 0.
Reference: MoEBlaze §4 (combine through token_index_map); docs/design.md §3.
"""

from __future__ import annotations

import torch


def _known_true(condition: bool | torch.SymBool) -> bool:
    """Whether a symbolic ``condition`` holds for every size (only while torch.compile traces).

    Imported here so that ``import memfine`` and eager calls load neither sympy nor dynamo.
    """
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def gather_rows(x_TD: torch.Tensor, expert_token_indices_S: torch.Tensor) -> torch.Tensor:
    """Return the (S, D) expert-grouped copy x[expert_token_indices] (a new tensor)."""
    return x_TD.index_select(0, expert_token_indices_S.long())


def slot_rows(rows_SD: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """(T, K, D) new tensor: the row of every slot; sentinel slots hold exact zeros.

    Memory: allocates the (T, K, D) gathered copy (transient for callers outside autograd).
    """
    S, D = rows_SD.shape
    T, K = token_index_map_TK.shape
    # S == 0 (every slot a sentinel): read a zero row, keeping the autograd graph. Under
    # torch.compile S is a symbolic size that may be 0, so the compiled graph keeps the row.
    if S < 1 if not torch.compiler.is_compiling() else not _known_true(S >= 1):
        rows_SD = torch.cat([rows_SD, rows_SD.new_zeros(1, D)])
    valid_TK = token_index_map_TK >= 0
    idx_M = token_index_map_TK.clamp(min=0).reshape(-1).long()
    rows_TKD = rows_SD.index_select(0, idx_M).view(T, K, D)
    # Selection, not multiplication: a sentinel slot's stand-in row may hold NaN/inf.
    return rows_TKD.masked_fill_(~valid_TK[..., None], 0)


def combine_rows(y_SD: torch.Tensor, weights_TK: torch.Tensor,
                 token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j w[t, j] · Y[token_index_map[t, j]] over valid slots, summed in slot order.

    Equal, bit for bit, to ``(w[..., None] * Y_slots).reshape(T, k, d).sum(1)``.

    Args:
        y_SD: (S, D) expert outputs in expert-grouped order.
        weights_TK: (T, k) routing weights; entries of sentinel slots are ignored (selected out).
        token_index_map_TK: (T, k) int32 rows, -1 for sentinel slots.

    Returns:
        (T, D) new tensor in y's dtype. Differentiable (autograd through index_select).

    Memory: a transient (T, k, D) gathered copy (kept by autograd when y requires grad
    outside a custom Function: the "scattered copy" of the plain path). Without autograd and
    with S = T·k (no sentinel slot) the rows are gathered directly (no sentinel mask or fill).
    """
    needs_graph = torch.is_grad_enabled() and (y_SD.requires_grad or weights_TK.requires_grad)
    (T, K), D = token_index_map_TK.shape, y_SD.shape[1]
    if needs_graph or (y_SD.shape[0] != T * K if not torch.compiler.is_compiling()
                       else not _known_true(y_SD.shape[0] == T * K)):
        rows_TKD = slot_rows(y_SD, token_index_map_TK)
    else:  # every slot has a row (no sentinel): gathered directly, nothing to clear
        rows_TKD = y_SD.index_select(0, token_index_map_TK.reshape(-1).long()).view(T, K, D)
    w_TK = torch.where(token_index_map_TK >= 0, weights_TK.to(y_SD.dtype), 0)
    if needs_graph:
        return (rows_TKD * w_TK[..., None]).sum(1)
    return rows_TKD.mul_(w_TK[..., None]).sum(1)  # NOTE(memory): in place, saves T·k·D


def reduce_rows(rows_SD: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j rows[token_index_map[t, j]] over valid slots (unweighted; used for dx).

    Returns:
        (T, D) new tensor. Memory: a transient (T, k, D) gathered copy.
    """
    return slot_rows(rows_SD, token_index_map_TK).sum(1)


def scatter_slots(values_S: torch.Tensor, expert_slot_indices_S: torch.Tensor,
                  shape_TK: tuple[int, int]) -> torch.Tensor:
    """Put per-row values back into a (T, k) slot tensor; sentinel slots get 0.

    Every slot owns at most one row, so the write has no duplicate index (deterministic).
    """
    out_TK = values_S.new_zeros(shape_TK)
    out_TK.view(-1).index_copy_(0, expert_slot_indices_S.long(), values_S)
    return out_TK
