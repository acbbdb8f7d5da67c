"""Expert-parallel models: sharding a built model, and full (gathered) state dicts.

A model is always built whole (every rank from the same seed, so initialisation equals the
single-process one), then :func:`shard_moe_layers` keeps each rank's slice of every expert
tensor. Checkpoints hold full expert tensors (E, ...), gathered over the EP group, with the names
and shapes of the single-process model, so a checkpoint loads at any EP size (including 1) by
slicing (:func:`load_full_state_dict`). Optimizer state tensors shaped like an expert parameter
are gathered and sliced the same way.
Reference: docs/design.md §4, §6 (parallel).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist

from memfine.parallel.collectives import agree_num_chunks
from memfine.parallel.experts import ExpertParallelExperts
from memfine.parallel.grads import is_expert_parameter
from memfine.parallel.groups import ParallelContext


def _run_experts_ep(layer: torch.nn.Module, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The MoE layer's ``run_experts`` hook under EP: c is chosen after the count exchange."""
    experts: ExpertParallelExperts = layer.experts  # type: ignore[assignment]
    return experts.run(x_TD, top_k_index, top_k_weights, policy=getattr(layer, "policy", None))


def shard_moe_layers(model: torch.nn.Module, context: ParallelContext) -> int:
    """Replace the experts of every MoE layer by this rank's :class:`ExpertParallelExperts`.

    A module counts as an MoE layer when it has a ``router`` and an ``experts`` child with
    ``w_up``, ``w_down`` and ``config`` (``memfine.nn.MoELayer``); shared experts (no router)
    stay whole on every rank, like the attention weights. Its ``run_experts`` hook is set, on
    this instance, to the EP path (notify → chunk policy on s″ → agreed c → chunks), and its
    chunk policy's ``agree_num_chunks`` to the all-reduce MAX over the EP group.

    Args:
        model: a built model, identical on every rank (same seed).
        context: this rank's :class:`ParallelContext`.

    Returns:
        The number of MoE layers sharded.

    Raises:
        ValueError: if an MoE layer's num_experts is not divisible by the EP size.
    """
    agree = functools.partial(agree_num_chunks, group=context.ep_group)
    reduce_counts = functools.partial(_sum_over_world, group=None)  # None: every rank
    layers = [m for m in model.modules() if hasattr(getattr(m, "experts", None), "w_up")
              and hasattr(m, "router") and not isinstance(m.experts, ExpertParallelExperts)]
    for layer in layers:
        full = layer.experts
        layer.experts = ExpertParallelExperts.from_full(full.w_up.detach(), full.w_down.detach(),
                                                        full.config, context)
        layer.run_experts = functools.partial(_run_experts_ep, layer)
        layer.reduce_expert_counts = reduce_counts  # global-batch f in the balancing loss
        policy = getattr(layer, "policy", None)
        if policy is not None:
            policy.agree_num_chunks = agree
    return len(layers)


def _sum_over_world(counts_E: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce SUM of per-expert assignment counts over every rank (the global batch)."""
    dist.all_reduce(counts_E, op=dist.ReduceOp.SUM, group=group)
    return counts_E


def _gather_experts(local: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(context.ep_size)]
    dist.all_gather(parts, local.contiguous(), group=context.ep_group)
    return torch.cat(parts)


def _local_slice(full: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    per_rank = full.shape[0] // context.ep_size
    return full[context.ep_rank * per_rank:(context.ep_rank + 1) * per_rank].clone()


def _expert_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if is_expert_parameter(p)}


def full_state_dict(model: torch.nn.Module, context: ParallelContext) -> dict[str, torch.Tensor]:
    """The model's state dict with every expert tensor gathered to its full (E, ...) shape.

    Side effects: one all-gather over the EP group per expert tensor (call on every rank).
    """
    state = model.state_dict()
    for name in _expert_names(model):
        state[name] = _gather_experts(state[name], context)
    return state


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor],
                         context: ParallelContext) -> None:
    """Load a full (single-process or gathered) state dict into a sharded model.

    Raises:
        ValueError: if an expert tensor's first dimension is not divisible by the EP size.
    """
    state = dict(state)
    for name in _expert_names(model):
        if name in state:
            if state[name].shape[0] % context.ep_size:
                raise ValueError(f"checkpoint tensor {name!r} has {state[name].shape[0]} experts, "
                                 f"not divisible by the expert-parallel size {context.ep_size}")
            state[name] = _local_slice(state[name], context)
    model.load_state_dict(state)


def _expert_state_ids(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Optimizer state-dict indices of the expert parameters (state-dict order of params)."""
    expert_ids = {id(p) for p in _expert_names(model).values()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i for i, p in enumerate(params) if id(p) in expert_ids}


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              context: ParallelContext) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the state tensors of expert parameters gathered.

    Side effects: all-gathers over the EP group (call on every rank).
    """
    state = optimizer.state_dict()
    out = {"state": copy.copy(state["state"]), "param_groups": state["param_groups"]}
    for i in sorted(_expert_state_ids(model, optimizer)):
        if i not in out["state"]:
            continue
        out["state"][i] = {key: (_gather_experts(v, context)
                                 if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                           for key, v in out["state"][i].items()}
    return out


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                   state: dict[str, Any], context: ParallelContext) -> None:
    """Load a full optimizer state dict (from any EP size) into this rank's optimizer."""
    out = {"state": copy.copy(state["state"]), "param_groups": state["param_groups"]}
    for i in _expert_state_ids(model, optimizer):
        if i not in out["state"]:
            continue
        out["state"][i] = {key: (_local_slice(v, context)
                                 if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                           for key, v in out["state"][i].items()}
    optimizer.load_state_dict(out)
