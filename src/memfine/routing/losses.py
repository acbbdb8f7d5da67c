"""Router losses: Switch load-balancing loss and z-loss, both padding-aware and in fp32.

Legend: T tokens, E experts, K top-k slots.
Reference: docs/design.md §2 (Switch Transformer convention: uniform routing gives 1.0).
"""

from __future__ import annotations

import torch


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _valid_rows(x_T: torch.Tensor, valid_mask_T: torch.Tensor | None) -> torch.Tensor:
    return x_T if valid_mask_T is None else x_T[valid_mask_T]


def load_balancing_loss(logits_TE: torch.Tensor, top_k_index_TK: torch.Tensor,
                        valid_mask_T: torch.Tensor | None = None, *,
                        counts_E: torch.Tensor | None = None,
                        tokens_per_rank: torch.Tensor | float | None = None) -> torch.Tensor:
    """Switch load-balancing loss E·Σ_i f_i·P_i.

    Args:
        logits_TE: (T, E) router logits (any float dtype; upcast to fp32). P_i is the mean over
            valid tokens of the full softmax of these logits, whatever the router's score function.
        top_k_index_TK: (T, k) int64 expert ids; ids outside [0, E) (sentinels) are not counted.
        valid_mask_T: optional (T,) bool; padding tokens are excluded by selection.
        counts_E: optional (E,) int assignment counts over the *global* batch (e.g. summed over
            the ranks of a data- or expert-parallel run). When given, f_i = counts_i / Σ counts
            replaces the local fraction.
        tokens_per_rank: optional T̄ = (global valid tokens) / W, the mean valid tokens per rank
            of the global batch (0-dim tensor or float). When given, P_i is this rank's share
            Σ_{t valid here} p_ti / T̄ instead of the local mean, so that with global
            ``counts_E`` the mean of the W per-rank losses (and of their gradients) is the loss
            of one process holding every rank's tokens, however the valid tokens are spread
            (8 and 2 on two ranks give the 10-token value).

    Returns:
        0-dim fp32 tensor. 1.0 for uniform routing with balanced assignments (any k); ≈E when every
        token picks one expert with k=1. 0.0 when there is no valid token. Differentiable w.r.t.
        the logits through P (f is a count).

    Reference: docs/design.md §2; f_i = assignments_i / (T·k).
    """
    T, E = logits_TE.shape
    k = top_k_index_TK.shape[-1]
    probs_TE = _valid_rows(_fp32(logits_TE).softmax(-1), valid_mask_T)
    index_TK = _valid_rows(top_k_index_TK, valid_mask_T)
    t_valid = probs_TE.shape[0]
    if t_valid == 0:
        return _fp32(logits_TE)[:0].sum()  # keeps the graph; exactly 0, NaN-safe
    p_E = probs_TE.mean(0) if tokens_per_rank is None else probs_TE.sum(0) / tokens_per_rank
    if counts_E is not None:
        if counts_E.shape != (E,):
            raise ValueError(f"counts_E must be (E,) with E={E}, got {tuple(counts_E.shape)}")
        f_E = counts_E.to(p_E.dtype) / counts_E.sum().clamp(min=1).to(p_E.dtype)
        return E * (f_E * p_E).sum()
    ids_M = index_TK.reshape(-1).long()
    ids_M = torch.where((ids_M >= 0) & (ids_M < E), ids_M, E)  # sentinels → spare bin E
    local_E = torch.bincount(ids_M, minlength=E + 1)[:E]
    f_E = local_E.to(p_E.dtype) / (t_valid * k)
    return E * (f_E * p_E).sum()


def z_loss(logits_TE: torch.Tensor, valid_mask_T: torch.Tensor | None = None, *,
           tokens_per_rank: torch.Tensor | float | None = None) -> torch.Tensor:
    """Router z-loss mean(logsumexp(logits)²) in fp32.

    Args:
        logits_TE: (T, E) router logits, any float dtype (upcast to fp32 first, so fp16 input
            stays finite).
        valid_mask_T: optional (T,) bool; padding tokens are excluded by selection.
        tokens_per_rank: optional T̄, the mean valid tokens per rank of the global batch: the
            result is then this rank's share Σ_{t valid here} lse_t² / T̄, whose mean over the
            ranks is the z-loss of the whole batch (see :func:`load_balancing_loss`).

    Returns:
        0-dim fp32 tensor; (ln E)² for all-zero logits; 0.0 when there is no valid token.

    Reference: ST-MoE (Zoph et al. 2022) z-loss; docs/design.md §2.
    """
    lse_T = _valid_rows(torch.logsumexp(_fp32(logits_TE), dim=-1), valid_mask_T)
    if lse_T.numel() == 0:
        return _fp32(logits_TE)[:0].sum()  # keeps the graph; exactly 0, NaN-safe
    if tokens_per_rank is not None:
        return (lse_T ** 2).sum() / tokens_per_rank
    return (lse_T ** 2).mean()
