"""AdamW with weight decay on matrices only, and its warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from memfine.config import TrainConfig

ADAM_BETAS = (0.9, 0.95)


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """LR multiplier for 0-based ``step``: linear warm-up, cosine to ``min_ratio``, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> tuple[
        torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay on tensors with ≥ 2 dims only) and its warm-up + cosine schedule.

    On CUDA the fused AdamW kernel updates all parameters at once (``fused=True``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = torch.device(config.device).type == "cuda" or None  # one kernel per step on CUDA
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=ADAM_BETAS, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, warmup_steps=config.warmup_steps, decay_steps=config.resolved_lr_decay_steps,
        min_ratio=config.min_lr_ratio))
    return optimizer, scheduler
