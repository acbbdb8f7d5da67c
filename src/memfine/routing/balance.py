"""Aux-loss-free load balancing: the per-expert selection bias update (DeepSeek-V3 §2.1.2).

Legend: E experts, L MoE layers.

The bias moves once per optimizer step from the step's *global* assignment counts: every rank
and every micro-batch of the step summed, each routing decision counted once (the router runs
once per layer and call, outside every recomputed region, so the counts in ``MoEAux`` never see
a recompute). The training loop sums the counts, reduces them over the data/expert-parallel
ranks and calls :func:`update_selection_bias` (or ``MoETransformerLM.update_expert_bias``) once,
after ``optimizer.step()``.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def update_selection_bias(selection_bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                          rate: float) -> torch.Tensor:
    """``bias_i += γ·sign(mean_load − load_i)`` in place, in fp32.

    Args:
        selection_bias: (E,) fp32 buffer (the router's ``selection_bias``), written in place.
        tokens_per_expert: (E,) int64 global assignment counts of the step (load_i).
        rate: γ >= 0 (``MoEConfig.bias_update_rate``); 0 leaves the bias unchanged.

    Returns:
        ``selection_bias`` (the same tensor). Overloaded experts move down by γ, underloaded
        ones up by γ, experts exactly at the mean stay.

    Raises:
        ValueError: if the shapes differ or rate is negative.

    Reference: DeepSeek-V3 §2.1.2 (auxiliary-loss-free load balancing, bias update speed γ).
    """
    if tokens_per_expert.shape != selection_bias.shape or selection_bias.dim() != 1:
        raise ValueError(f"tokens_per_expert must be (E,)={tuple(selection_bias.shape)}, got "
                         f"{tuple(tokens_per_expert.shape)}")
    if not rate >= 0:
        raise ValueError(f"rate must be >= 0, got {rate}")
    load_E = tokens_per_expert.to(device=selection_bias.device, dtype=torch.float64)
    step_E = torch.sign(load_E.mean() - load_E) * rate
    selection_bias.add_(step_E.to(selection_bias.dtype))
    return selection_bias
