"""Gradient reduction and clipping for expert parallelism with data parallelism around it.

We use explicit all-reduces (no DistributedDataParallel): the training loss of every rank is the
mean over its own tokens, and the global loss is the mean over the W ranks (equal token counts).
- Replicated (non-expert) parameters: rank r holds ∂L_r/∂θ, so the global gradient is the mean over
  all W ranks: one all-reduce (SUM, then /W) over the world.
- Expert parameters (marked ``expert_parallel``): the owner's gradient already sums the
  contributions of every rank of its EP group (the all-to-all backward brings them home), i.e.
  Σ_{r in EP group} ∂L_r/∂W. The global gradient is that, summed over the W/e EP groups that hold
  replicas of the same shard, divided by W: one all-reduce (SUM) over the expert-DP group, then /W.
  With W = e (no data parallelism) that is only the division.
Reference: docs/design.md §4, §6 (parallel).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from memfine.parallel.collectives import collective_device
from memfine.parallel.groups import ParallelContext


def is_expert_parameter(param: torch.Tensor) -> bool:
    """True for parameters sharded over the EP group (``expert_parallel`` attribute set)."""
    return bool(getattr(param, "expert_parallel", False))


def _filled_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Gradients of ``params``; a missing one becomes zeros so every rank reduces equal shapes."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(params: Iterable[torch.nn.Parameter], context: ParallelContext) -> None:
    """Turn each rank's local gradients into the gradients of the global mean loss, in place.

    Args:
        params: all trainable parameters of the model (same order on every rank).
        context: this rank's :class:`ParallelContext`.

    Side effects: writes ``p.grad`` (a missing gradient becomes zeros); one all-reduce over the
    world (replicated parameters) and, with W > e, one over the expert-DP group (experts).
    """
    params = [p for p in params if p.requires_grad]
    shared = _filled_grads([p for p in params if not is_expert_parameter(p)])
    experts = _filled_grads([p for p in params if is_expert_parameter(p)])
    _all_reduce_flat(shared, None)
    if context.dp_size > 1:
        _all_reduce_flat(experts, context.expert_dp_group)
    for g in shared + experts:
        g.div_(context.world_size)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float,
                   context: ParallelContext) -> torch.Tensor:
    """Clip the global L2 norm of synchronised gradients, as one process would.

    The global norm counts each replicated parameter once and each expert once: the squared norm
    of the local experts is summed over the EP group (every EP group holds all E experts).

    Args:
        params: the parameters after :func:`sync_gradients`.
        max_norm: largest allowed norm; ``math.inf`` only measures.
        context: this rank's :class:`ParallelContext`.

    Returns:
        0-dim fp32 tensor, the global norm before clipping (equal on every rank).

    Side effects: scales ``p.grad`` in place by min(1, max_norm / (norm + 1e-6)), the factor of
    ``torch.nn.utils.clip_grad_norm_``; one all-reduce of one float over the EP group.
    """
    params = [p for p in params if p.grad is not None]
    dev = collective_device(context.ep_group)
    shared_sq = sum((p.grad.float().pow(2).sum() for p in params
                     if not is_expert_parameter(p)), torch.zeros(()))
    expert_sq = sum((p.grad.float().pow(2).sum() for p in params if is_expert_parameter(p)),
                    torch.zeros(()))
    expert_sq = expert_sq.to(dev)
    dist.all_reduce(expert_sq, group=context.ep_group)
    total = (shared_sq.to(dev) + expert_sq).sqrt().cpu()
    if max_norm != math.inf:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
