"""Sharding a built model over the (dp_shard, ep) mesh with FSDP2, and gradient-norm clipping.

:func:`shard_model` swaps every MoE layer's ``experts`` for the expert-parallel ones, then
applies ``fully_shard`` (experts over ``dp_shard``, blocks and root over ``dp``). FSDP2
reduce-scatters the gradients; nothing is all-reduced by hand.

Gradient scaling: every rank's loss is the mean over its own tokens, so the gradient of the
global mean loss is the mean over the W ranks. FSDP2 divides dense gradients by W (the size of
``dp``). An expert's gradient on its owner already sums the contributions of its whole ``ep``
group (the all-to-all backward brings them home), so the experts scale it by 1/ep
(``grad_scale``) and FSDP2 divides by the size of ``dp_shard``: 1/W in all. (torchtitan sets an
FSDP gradient divide factor instead; in torch 2.13 a size-1 ``dp_shard`` then divides twice.)
Reductions are SUM followed by a division (``set_force_sum_reduction_for_comms``): gloo has no
AVG or PREMUL_SUM; nccl takes the same path.
Reference: torchtitan's ``apply_fsdp`` (experts over the expert-data-parallel dim);
docs/design.md §4.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from memfine.config import MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.parallel.experts import ExpertParallelExperts
from memfine.parallel.lora_experts import ExpertParallelLoRAExperts
from memfine.parallel.mesh import ParallelContext


def _is_moe_layer(module: nn.Module) -> bool:
    """A module with a ``router`` and an ``experts`` child holding ``w_up``, ``w_down``, ``config``.

    A 4-bit base (``quantized`` experts, QLoRA) holds its codes instead of ``w_up``/``w_down``.

    Shared experts (:class:`memfine.nn.shared.SharedExperts`, no router) are not MoE layers: they
    stay whole on every rank's ``ep`` slice and are sharded over ``dp`` like the attention.
    """
    experts = getattr(module, "experts", None)
    return hasattr(module, "router") and isinstance(experts, nn.Module) and all(
        hasattr(experts, a) for a in ("config", *(() if getattr(experts, "quantized", False)
                                                  else ("w_up", "w_down"))))


def _fully_shard(module: nn.Module, mesh: DeviceMesh) -> FSDPModule:
    fully_shard(module, mesh=mesh)
    assert isinstance(module, FSDPModule), "fully_shard did not make an FSDPModule"
    module.set_force_sum_reduction_for_comms(True)
    return module


def _expert_parallel(full: nn.Module, context: ParallelContext) -> ExpertParallelExperts:
    """This rank's experts of a whole experts module (with its LoRA adapters when it has them)."""
    if isinstance(getattr(full, "lora", None), LoRAConfig):  # memfine.nn.lora.LoRAGroupedExperts
        return ExpertParallelLoRAExperts.from_lora_experts(full, context,
                                                           grad_scale=1.0 / context.ep_size)
    w_up, w_down, config = full.w_up, full.w_down, full.config
    assert isinstance(w_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
    assert isinstance(config, MoEConfig)
    return ExpertParallelExperts.from_full(w_up, w_down, config, context,
                                           grad_scale=1.0 / context.ep_size)


def shard_model(model: nn.Module, context: ParallelContext) -> int:
    """Shard a built model in place: experts over ``ep`` and ``dp_shard``, the rest over ``dp``.

    Args:
        model: a model built whole and identically on every rank (same seed), e.g.
            :class:`memfine.nn.MoETransformerLM`; blocks are found as ``model.blocks``.
        context: this rank's :class:`ParallelContext`.

    Returns:
        The number of MoE layers whose experts were swapped.

    Raises:
        ValueError: if an MoE layer's num_experts is not divisible by ep.

    Side effects: replaces ``layer.experts`` of every MoE layer (nothing else of the layer
    changes; experts with LoRA adapters become :class:`ExpertParallelLoRAExperts`, frozen base
    and trained adapters both sharded); turns the experts, the blocks and the root into FSDP2
    modules (parameters become DTensors; the experts' ``run`` is registered as an FSDP forward
    method).
    """
    layers = [m for m in model.modules() if _is_moe_layer(m)
              and not isinstance(m.experts, ExpertParallelExperts)]
    for layer in layers:
        full = layer.experts
        assert isinstance(full, nn.Module)  # _is_moe_layer checked it and its weights
        experts = _expert_parallel(full, context)
        layer.experts = experts
        _fully_shard(experts, context.expert_dp_mesh)
        register_fsdp_forward_method(experts, "run")
    for block in getattr(model, "blocks", ()):
        _fully_shard(block, context.dp_mesh)
    _fully_shard(model, context.dp_mesh)
    return len(layers)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for DTensor gradients on several meshes.

    The dense gradients live on the ``dp`` mesh and the experts' on (dp_shard, ep); one
    ``torch.nn.utils.get_total_norm`` per mesh gives a DTensor norm whose ``full_tensor()`` is
    the norm over every shard; the global norm combines them, and
    ``torch.nn.utils.clip_grads_with_norm_`` scales each mesh's gradients.

    Args:
        parameters: the model's parameters (plain or DTensor).
        max_norm: largest allowed norm; ``math.inf`` only measures.
        norm_type: p of the p-norm.

    Returns:
        0-dim fp32 tensor, the global norm before clipping, equal on every rank.

    Side effects: one all-reduce per mesh (``full_tensor``); scales ``p.grad`` in place by
    min(1, max_norm / (norm + 1e-6)).
    """
    groups: dict[int, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(id(mesh), []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                             norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    for params in groups.values():
        device = params[0].grad.device if params[0].grad is not None else total.device
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(device))
    return total
