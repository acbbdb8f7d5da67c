"""Router losses: Switch load-balancing loss and z-loss, both padding-aware and in fp32.

Legend: T tokens, E experts, K top-k slots.
Reference: docs/design.md §2 (Switch Transformer convention: uniform routing gives 1.0).
"""

from __future__ import annotations

import torch

from memfine.routing.precision import count_per_expert, fp32_routing


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _select_valid(logits_TE: torch.Tensor, valid_mask_T: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits with padding rows replaced by 0 (selection: NaN/inf there never propagate)."""
    logits_TE = _fp32(logits_TE)
    return logits_TE if valid_mask_T is None else torch.where(valid_mask_T[:, None], logits_TE, 0)


def _masked_mean(x_T: torch.Tensor, valid_mask_T: torch.Tensor | None) -> torch.Tensor:
    """Mean over the valid rows of x (dim 0), 0 when there is none.

    Padding rows are removed by selection (``torch.where``), not by indexing, so the shapes do
    not depend on the mask (``torch.compile`` traces it without a data-dependent size).
    """
    if valid_mask_T is None:
        return x_T.mean(0) if x_T.shape[0] else x_T.sum(0)
    mask = valid_mask_T.reshape(-1, *([1] * (x_T.dim() - 1)))
    total = torch.where(mask, x_T, 0).sum(0)
    return total / valid_mask_T.sum().clamp(min=1).to(x_T.dtype)


@fp32_routing
def load_balancing_loss(logits_TE: torch.Tensor, top_k_index_TK: torch.Tensor,
                        valid_mask_T: torch.Tensor | None = None, *,
                        counts_E: torch.Tensor | None = None) -> torch.Tensor:
    """Switch load-balancing loss E·Σ_i f_i·P_i.

    Args:
        logits_TE: (T, E) router logits (any float dtype; upcast to fp32). P_i is the mean over
            valid tokens of the full softmax of these logits, whatever the router's score function.
        top_k_index_TK: (T, k) int64 expert ids; ids outside [0, E) (sentinels) are not counted.
        valid_mask_T: optional (T,) bool; padding tokens are excluded by selection.
        counts_E: optional (E,) int assignment counts over the *global* batch (e.g. summed over
            the ranks of a data- or expert-parallel run). When given, f_i = counts_i / Σ counts
            replaces the local fraction and P stays local, so the mean of the per-rank losses
            equals the loss of one process on the whole batch (equal tokens per rank).

    Returns:
        0-dim fp32 tensor. 1.0 for uniform routing with balanced assignments (any k); ≈E when every
        token picks one expert with k=1. 0.0 when there is no valid token. Differentiable w.r.t.
        the logits through P (f is a count).

    Reference: docs/design.md §2; f_i = assignments_i / (T·k).
    """
    T, E = logits_TE.shape
    k = top_k_index_TK.shape[-1]
    p_E = _masked_mean(_select_valid(logits_TE, valid_mask_T).softmax(-1), valid_mask_T)
    if counts_E is not None:
        if counts_E.shape != (E,):
            raise ValueError(f"counts_E must be (E,) with E={E}, got {tuple(counts_E.shape)}")
        f_E = counts_E.to(p_E.dtype) / counts_E.sum().clamp(min=1).to(p_E.dtype)
        return E * (f_E * p_E).sum()
    index_TK = top_k_index_TK
    if valid_mask_T is not None:  # padding slots → sentinel E (not counted)
        index_TK = torch.where(valid_mask_T[:, None], top_k_index_TK, E)
    t_valid = max(T, 1) if valid_mask_T is None else valid_mask_T.sum().clamp(min=1)
    f_E = count_per_expert(index_TK, E).to(p_E.dtype) / (t_valid * k)
    return E * (f_E * p_E).sum()


@fp32_routing
def z_loss(logits_TE: torch.Tensor, valid_mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss mean(logsumexp(logits)²) in fp32.

    Args:
        logits_TE: (T, E) router logits, any float dtype (upcast to fp32 first, so fp16 input
            stays finite).
        valid_mask_T: optional (T,) bool; padding tokens are excluded by selection.

    Returns:
        0-dim fp32 tensor; (ln E)² for all-zero logits; 0.0 when there is no valid token.

    Reference: ST-MoE (Zoph et al. 2022) z-loss; docs/design.md §2.
    """
    lse_T = torch.logsumexp(_select_valid(logits_TE, valid_mask_T), dim=-1)
    return _masked_mean(lse_T ** 2, valid_mask_T)
