"""Router losses: Switch and sequence-wise load-balancing losses and z-loss, in fp32.

All three are padding-aware: a mask (bool, or integer 0/1 of the token shape) leaves padding
tokens out by selection.

Legend: T tokens, E experts, K top-k slots, B sequences, Q tokens per sequence.
Reference: docs/design.md §2 (Switch Transformer convention: uniform routing gives 1.0); DeepSeek-V3
(arXiv 2412.19437) Eq. 17-20 (sequence-wise balance loss).
"""

from __future__ import annotations

from typing import overload

import torch

from memfine.routing.precision import count_per_expert, fp32_routing


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@overload
def check_token_mask(valid_mask: torch.Tensor, num_tokens: int,
                     name: str = "valid_mask") -> torch.Tensor: ...
@overload
def check_token_mask(valid_mask: None, num_tokens: int, name: str = "valid_mask") -> None: ...
def check_token_mask(valid_mask: torch.Tensor | None, num_tokens: int,
                     name: str = "valid_mask") -> torch.Tensor | None:
    """Validate a padding mask of T tokens and return it as (T,) bool.

    Args:
        valid_mask: ``None``, or a (T,) tensor: bool, or integer (an attention mask such as
            Hugging Face's int64 0/1 ``attention_mask``; nonzero = a real token). Float masks
            are rejected: an additive mask (0 / -inf) would read the other way round.
        num_tokens: T.
        name: the argument name used in error messages.

    Returns:
        ``None`` or a (T,) bool tensor: the input itself when already bool, else
        ``valid_mask != 0`` (computed on the device: no host read, no sync).

    Raises:
        ValueError: naming the argument, if the mask is not (T,) or not bool/integer.
    """
    if valid_mask is None:
        return None
    if tuple(valid_mask.shape) != (num_tokens,):
        raise ValueError(f"{name} must have the token shape (T,)=({num_tokens},), got "
                         f"{tuple(valid_mask.shape)}")
    if valid_mask.dtype == torch.bool:
        return valid_mask
    if valid_mask.is_floating_point() or valid_mask.is_complex():
        raise ValueError(f"{name} must be bool or an integer 0/1 mask (nonzero = a real token), "
                         f"got {valid_mask.dtype} (a float mask is ambiguous: additive -inf)")
    return valid_mask != 0


def _select_valid(logits_TE: torch.Tensor, valid_mask_T: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits with padding rows replaced by 0 (selection: NaN/inf there never propagate)."""
    logits_TE = _fp32(logits_TE)
    return logits_TE if valid_mask_T is None else torch.where(valid_mask_T[:, None], logits_TE, 0)


def _masked_mean(x_T: torch.Tensor, valid_mask_T: torch.Tensor | None,
                 tokens_per_rank: torch.Tensor | float | None = None) -> torch.Tensor:
    """Mean over the valid rows of x (dim 0), 0 when there is none.

    With ``tokens_per_rank`` (T̄) it is the sum over the valid rows divided by T̄. Padding rows
    are removed by selection (``torch.where``), not by indexing, so the shapes do not depend on
    the mask (``torch.compile`` traces it without a data-dependent size).
    """
    if valid_mask_T is not None:
        mask = valid_mask_T.reshape(-1, *([1] * (x_T.dim() - 1)))
        x_T = torch.where(mask, x_T, 0)
    if tokens_per_rank is not None:
        return x_T.sum(0) / tokens_per_rank
    if valid_mask_T is None:
        return x_T.mean(0) if x_T.shape[0] else x_T.sum(0)
    return x_T.sum(0) / valid_mask_T.sum().clamp(min=1).to(x_T.dtype)


@fp32_routing
def load_balancing_loss(logits_TE: torch.Tensor, top_k_index_TK: torch.Tensor,
                        valid_mask_T: torch.Tensor | None = None, *,
                        counts_E: torch.Tensor | None = None,
                        tokens_per_rank: torch.Tensor | float | None = None) -> torch.Tensor:
    """Switch load-balancing loss E·Σ_i f_i·P_i.

    Args:
        logits_TE: (T, E) router logits (any float dtype; upcast to fp32). P_i is the mean over
            valid tokens of the full softmax of these logits, whatever the router's score function.
        top_k_index_TK: (T, k) int64 expert ids; ids outside [0, E) (sentinels) are not counted.
        valid_mask_T: optional (T,) bool or integer 0/1 mask; padding tokens are excluded by
            selection.
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

    Raises:
        ValueError: if the logits are not (T, E), the index not (T, k), the mask not a (T,)
            bool or 0/1 mask, or counts_E not (E,).

    Reference: docs/design.md §2; f_i = assignments_i / (T·k).
    """
    if logits_TE.dim() != 2 or top_k_index_TK.dim() != 2 or (
            top_k_index_TK.shape[0] != logits_TE.shape[0]):
        raise ValueError(f"logits must be (T, E) and top_k_index (T, k), got "
                         f"{tuple(logits_TE.shape)} and {tuple(top_k_index_TK.shape)}")
    T, E = logits_TE.shape
    k = top_k_index_TK.shape[-1]
    valid_mask_T = check_token_mask(valid_mask_T, T)
    p_E = _masked_mean(_select_valid(logits_TE, valid_mask_T).softmax(-1), valid_mask_T,
                       tokens_per_rank)
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
def z_loss(logits_TE: torch.Tensor, valid_mask_T: torch.Tensor | None = None, *,
           tokens_per_rank: torch.Tensor | float | None = None) -> torch.Tensor:
    """Router z-loss mean(logsumexp(logits)²) in fp32.

    Args:
        logits_TE: (T, E) router logits, any float dtype (upcast to fp32 first, so fp16 input
            stays finite).
        valid_mask_T: optional (T,) bool or integer 0/1 mask; padding tokens are excluded by
            selection.
        tokens_per_rank: optional T̄, the mean valid tokens per rank of the global batch: the
            result is then this rank's share Σ_{t valid here} lse_t² / T̄, whose mean over the
            ranks is the z-loss of the whole batch (see :func:`load_balancing_loss`).

    Returns:
        0-dim fp32 tensor; (ln E)² for all-zero logits; 0.0 when there is no valid token.

    Raises:
        ValueError: if the logits are not (T, E) or the mask is not a (T,) bool or 0/1 mask.

    Reference: ST-MoE (Zoph et al. 2022) z-loss; docs/design.md §2.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be (T, E), got {tuple(logits_TE.shape)}")
    valid_mask_T = check_token_mask(valid_mask_T, logits_TE.shape[0])
    lse_T = torch.logsumexp(_select_valid(logits_TE, valid_mask_T), dim=-1)
    return _masked_mean(lse_T ** 2, valid_mask_T, tokens_per_rank)


@fp32_routing
def sequence_balance_loss(scores_TE: torch.Tensor, top_k_index_TK: torch.Tensor,
                          seq_len: int, valid_mask_T: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss Σ_i f_i·P_i per sequence, averaged over sequences.

    Per sequence of Q' valid tokens: f_i = E/(k·Q')·(assignments of expert i),
    P_i = (1/Q')·Σ_t s'_{i,t} with s' = s / Σ_j s_j (the router scores normalised over the E
    experts: for softmax scores s' = s). Uniform routing with balanced assignments gives 1.0.
    The mean runs over sequences (no 1/B factor beyond it): two identical sequences give the
    value of one. Sequences without valid tokens are left out of the mean.

    Args:
        scores_TE: (T, E) router scores (softmax or sigmoid, before any selection bias),
            T = B·Q in sequence-major order; differentiable.
        top_k_index_TK: (T, k) int64 expert ids; sentinels (outside [0, E)) are not counted.
        seq_len: Q, tokens per sequence (T must be a multiple).
        valid_mask_T: optional (T,) bool or integer 0/1 mask.

    Returns:
        0-dim fp32 tensor (0.0 without valid tokens). Multiply by α (``seq_aux_loss_coef``).

    Raises:
        ValueError: if T is not a multiple of seq_len or the shapes/mask do not match.

    Reference: DeepSeek-V3 (arXiv 2412.19437) Eq. 17-20.
    """
    T, E = scores_TE.shape
    k = top_k_index_TK.shape[-1]
    if seq_len < 1 or T % seq_len or top_k_index_TK.shape[0] != T:
        raise ValueError(f"scores (T, E)={tuple(scores_TE.shape)} and top_k_index "
                         f"{tuple(top_k_index_TK.shape)} must hold whole sequences of "
                         f"seq_len={seq_len} tokens")
    mask_T = check_token_mask(valid_mask_T, T)
    B = T // seq_len
    s_TE = _fp32(scores_TE)
    s_TE = s_TE / s_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(s_TE.dtype).tiny)
    valid_T = (torch.ones(T, dtype=torch.bool, device=s_TE.device) if mask_T is None
               else mask_T)
    weight_T = valid_T.to(s_TE.dtype)
    ids_TK = torch.where((top_k_index_TK >= 0) & (top_k_index_TK < E) & valid_T[:, None],
                         top_k_index_TK, E)
    onehot_TE = torch.zeros(T, E + 1, dtype=s_TE.dtype, device=s_TE.device)
    onehot_TE.scatter_add_(1, ids_TK, torch.ones_like(ids_TK, dtype=s_TE.dtype))
    counts_BE = onehot_TE[:, :E].view(B, seq_len, E).sum(1)
    tokens_B = weight_T.view(B, seq_len).sum(1)
    p_BE = (torch.where(valid_T[:, None], s_TE, 0.0)).view(B, seq_len, E).sum(1)
    denom_B = tokens_B.clamp(min=1)
    f_BE = counts_BE * (E / k) / denom_B[:, None]
    per_seq_B = (f_BE * p_BE / denom_B[:, None]).sum(-1)
    has_B = tokens_B > 0
    num = has_B.sum().clamp(min=1).to(s_TE.dtype)
    return torch.where(has_B, per_seq_B, 0.0).sum() / num
