"""memfine's expert computation on a framework's experts module (one chunk of tokens).

Shared by the transformers backend (:mod:`memfine.integrations.transformers`) and the torchtitan
converter (:mod:`memfine.integrations.torchtitan`): both hand over their weights as
:class:`~memfine.hf.layout.ExpertWeights` views and their chunk options.

Two paths (chosen by :func:`memfine.hf.layout.plan_experts`):
- ``fused``: :func:`memfine.experts.run_experts` (MoEBlaze fused Function: saves x and H only) on
  transposed views of the module's weights;
- ``plain``: grouped matmuls over the expert-grouped rows (:class:`GroupedMatmulFunction`), the
  biases added per row, the module's own ``_apply_gate`` / ``act_fn`` / ``post_expert_norm``,
  and memfine's deterministic combine. Exact for any gate; saves what autograd saves.
Sentinel expert ids (outside [0, E), e.g. ``>= num_experts`` under expert parallelism) get no row
in the routing index, so they contribute exactly zero and their routing weights get zero gradient.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n (gated) or n.
Reference: MoEBlaze §3-§5 (index, fused path); docs/design.md §7.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, cast, get_args

import torch
from torch import nn

from memfine.config import Activation, ChunkConfig, MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.dispatch import RoutingIndex, build_routing_index
from memfine.experts import autocast_operands, compute_element_size, run_experts
from memfine.experts.lora_experts import run_lora_experts
from memfine.experts.run import grouped_up_projection
from memfine.hf.layout import ExpertsPlan, ExpertWeights
from memfine.lora.adapters import ExpertLoRA
from memfine.ops import GroupedMatmulFunction, combine_rows, gather_rows
from memfine.ops.weight_grads import WeightGradBuffers, share_weight_grads
from memfine.schedule.chunked import run_chunked
from memfine.schedule.lora_policy import LoRAChunkPolicy
from memfine.schedule.policy import ChunkDecision, ChunkPlan, ChunkPolicy

IndexBuilder = Literal["auto", "sort_free", "argsort"]
_RowsFn = Callable[[torch.Tensor], torch.Tensor]  # a module's activation or norm, row-wise
_POLICY_ATTRIBUTE = "_memfine_chunk_policy"  # the ChunkPolicy kept on an experts module


def _rows_bias(bias_EO: torch.Tensor, index: RoutingIndex) -> torch.Tensor:
    """(S, O) bias of each routed row's expert (rows are grouped by expert)."""
    E = bias_EO.shape[0]
    counts_E = index.tokens_per_expert().long()
    expert_of_row_S = torch.repeat_interleave(torch.arange(E, device=bias_EO.device), counts_E,
                                              output_size=index.num_rows)
    return bias_EO.index_select(0, expert_of_row_S)


def compute_dtype(x_TD: torch.Tensor, weights_dtype: torch.dtype) -> torch.dtype:
    """The dtype the experts compute in (autocast's, else the weights').

    Inside ``torch.autocast`` on x's device it is the autocast dtype (for floating weights other
    than float64, as autocast treats ``nn.Linear``); otherwise ``weights_dtype``.
    """
    device_type = x_TD.device.type
    if (weights_dtype.is_floating_point and weights_dtype != torch.float64
            and torch.amp.is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)):
        return torch.get_autocast_dtype(device_type)
    return weights_dtype


def autocast_weights(x_TD: torch.Tensor, weights: ExpertWeights) -> ExpertWeights:
    """``weights`` cast to the autocast dtype inside ``torch.autocast`` (else unchanged).

    The plain path's grouped matmuls are autograd Functions, which autocast does not cast; this
    casts their operands as :func:`memfine.experts.autocast_operands` does for the fused path. The
    casts are new tensors that the matmuls save for backward (as autocast's copies of an
    ``nn.Linear`` weight); gradients reach the parameters through the cast in their dtype.
    """
    _, w_up, w_second, w_down, b_up, b_down = autocast_operands(
        x_TD, weights.w_up_EDG, weights.w_up_second_EDN, weights.w_down_END, weights.b_up_EG,
        weights.b_down_ED)
    return ExpertWeights(w_up_EDG=w_up, w_down_END=w_down, b_up_EG=b_up, b_down_ED=b_down,
                         w_up_second_EDN=w_second)


def experts_module_plain(module: nn.Module, x_TD: torch.Tensor, top_k_weights: torch.Tensor,
                         index: RoutingIndex, weights: ExpertWeights,
                         backend: str = "auto") -> torch.Tensor:
    """The plain path: grouped matmuls, per-row biases and the module's own gate functions.

    Args:
        module: the transformers experts module (its ``_apply_gate`` or ``act_fn`` and, when
            ``has_post_expert_norm``, ``post_expert_norm`` are called on the routed rows).
        x_TD: (T, d) activations in the weights' dtype.
        top_k_weights: (T, k) routing weights.
        index: the routing index of this chunk.
        weights: the module's weights in memfine's layout.
        backend: grouped GEMM backend.

    Returns:
        (T, d) in x's dtype.

    Memory (saved for backward): gathered x (S·d), H (S·G) and whatever the module's gate
    saves, A (S·n), Y (S·d) and the (T, k, d) rows of the combine, plus indices.
    """
    offsets = index.expert_token_offsets
    x_SD = gather_rows(x_TD, index.expert_token_indices)
    h_SG = grouped_up_projection(x_SD, weights.w_up, offsets, backend)
    if weights.b_up_EG is not None:
        h_SG = h_SG + _rows_bias(weights.b_up_EG, index)
    gated = getattr(module, "has_gate", True)
    activate = cast(_RowsFn, module._apply_gate if gated else module.act_fn)
    a_SN = activate(h_SG)
    y_SD = GroupedMatmulFunction.apply(a_SN.contiguous(), weights.w_down_END, offsets, backend)
    if weights.b_down_ED is not None:
        y_SD = y_SD + _rows_bias(weights.b_down_ED, index)
    if getattr(module, "has_post_expert_norm", False):
        y_SD = cast(_RowsFn, module.post_expert_norm)(y_SD)
    return combine_rows(y_SD, top_k_weights, index.token_index_map)


def run_module_experts(module: nn.Module, plan: ExpertsPlan, weights: ExpertWeights,
                       x_TD: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, *, backend: str = "auto",
                       index_builder: IndexBuilder = "auto",
                       weight_grads: WeightGradBuffers | None = None,
                       lora: ExpertLoRA | None = None,
                       block_rows: int | None = None) -> torch.Tensor:
    """Route-free expert part of one chunk: build the index, run the planned path.

    Args:
        module: the transformers experts module.
        plan: its :class:`ExpertsPlan`.
        weights: its weights in memfine's layout (views).
        x_TD: (T, d) activations in the weights' dtype.
        top_k_index: (T, k) int64/int32 expert ids; ids outside [0, E) are sentinels (zero).
        top_k_weights: (T, k) routing weights (any float dtype; cast to x's).
        backend: grouped GEMM backend (``auto`` falls back to a per-expert loop where
            ``torch._grouped_mm``'s alignment rules fail, e.g. n = 30 in fp32).
        index_builder: routing-index builder.
        weight_grads: fused path: the chunk loop's shared weight-gradient buffers of ``w_up``
            and ``w_down`` (:func:`memfine.ops.weight_grads.share_weight_grads`), or None.
        lora: fused path: PEFT's adapters of this module as :class:`ExpertLoRA` (split LoRA,
            :func:`memfine.experts.lora_experts.run_lora_experts`), or None.
        block_rows: fused path: rows per row block (the chunk policy's plan), or None for the
            device default (an unchunked call).

    Returns:
        (T, d) in x's dtype.

    Memory: see :class:`memfine.experts.FusedExpertsFunction` (fused) and
    :func:`experts_module_plain` (plain).
    """
    index = build_routing_index(top_k_index, weights.shape_EDGN[0], index_builder)
    if lora is not None and plan.path != "fused":
        raise ValueError(f"split LoRA needs the fused path, {type(module).__name__} takes the "
                         f"plain one ({plan.reason})")
    if plan.path == "fused":
        assert plan.activation is not None, "the fused plan carries an activation"
        if lora is not None:
            return run_lora_experts(x_TD, top_k_weights, index, weights.w_up, weights.w_down_END,
                                    lora, activation=plan.activation, backend=backend,
                                    b_up_EG=weights.b_up_EG, b_down_ED=weights.b_down_ED,
                                    block_rows=block_rows, weight_grads=weight_grads)
        return run_experts(x_TD, top_k_weights, index, weights.w_up, weights.w_down_END,
                           activation=plan.activation, impl="fused", backend=backend,
                           b_up_EG=weights.b_up_EG, b_down_ED=weights.b_down_ED,
                           block_rows=block_rows, weight_grads=weight_grads)
    return experts_module_plain(module, x_TD, top_k_weights.to(x_TD.dtype), index,
                                autocast_weights(x_TD, weights), backend)


def chunk_policy(module: object, plan: ExpertsPlan, weights: ExpertWeights, top_k: int,
            chunk: ChunkConfig, lora: ExpertLoRA | None = None) -> ChunkPolicy:
    """The module's :class:`ChunkPolicy` for a memory budget.

    The policy is kept on the module, so its over-budget warning is given once. With split-LoRA
    adapters (PEFT's, on the fused path) it is a
    :class:`memfine.schedule.lora_policy.LoRAChunkPolicy`: MACT then compares the LoRA layer's
    peak (the adapters' rank-r intermediates, their gradients, no base weight gradient) with the
    budget.
    """
    E, D, G, N = weights.shape_EDGN
    # The memory model needs only G and whether A replaces H (relu): a GatedActivation spec
    # counts as swiglu; every named activation is a MoEConfig name.
    activation: Activation = "swiglu" if G == 2 * N else "silu"
    if plan.activation in get_args(Activation):
        activation = cast(Activation, plan.activation)
    # k ≤ E_local need not hold under expert parallelism; the memory model is per received row.
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=min(top_k, E),
                    renormalize=False, activation=activation)
    adapters = None if lora is None else lora_config(lora)
    cached = getattr(module, _POLICY_ATTRIBUTE, None)
    if (cached is not None and cached.config == chunk and cached.moe == moe
            and getattr(cached, "lora", None) == adapters):
        return cached
    policy = ChunkPolicy(chunk, moe) if adapters is None else LoRAChunkPolicy(chunk, moe, adapters)
    setattr(module, _POLICY_ATTRIBUTE, policy)
    return policy


def lora_config(lora: ExpertLoRA) -> LoRAConfig:
    """The :class:`LoRAConfig` the memory model reads from one call's adapters.

    Rank from A's shape, α = s·r, the adapted weights; the router is counted as trained (the
    transformers backend does not own it, so nothing is assumed frozen).
    """
    a = lora.a_up_ERD if lora.a_up_ERD is not None else lora.a_down_ERN
    assert a is not None, "an ExpertLoRA adapts at least one weight"
    rank = a.shape[1]
    targets = tuple(t for t, present in (("w_up", lora.a_up_ERD is not None),
                                         ("w_down", lora.a_down_ERN is not None)) if present)
    return LoRAConfig(rank=rank, alpha=lora.scale * rank, dropout=lora.dropout, targets=targets,
                      train_router=True)


def num_chunks_for(module: object, plan: ExpertsPlan, weights: ExpertWeights,
                   x_TD: torch.Tensor, top_k_index: torch.Tensor, chunk: ChunkConfig,
                   lora: ExpertLoRA | None = None) -> int:
    """Chunk count c of this call: :func:`chunk_plan_for`'s (arguments and errors as there)."""
    return chunk_plan_for(module, plan, weights, x_TD, top_k_index, chunk, lora).num_chunks


def chunk_plan_for(module: object, plan: ExpertsPlan, weights: ExpertWeights,
                   x_TD: torch.Tensor, top_k_index: torch.Tensor, chunk: ChunkConfig,
                   lora: ExpertLoRA | None = None) -> ChunkPlan:
    """C and row blocks of this call: ``chunk.num_chunks``, or MemFine Eq. 8-9 from the budget.

    Args:
        module: the experts module, or any object that keeps the budget's :class:`ChunkPolicy`.
        plan: the module's :class:`ExpertsPlan` (its activation enters the memory model).
        weights: the module's :class:`ExpertWeights` (E, d, n for the memory model).
        x_TD: (T, d) activations (T and the element size enter the memory model).
        top_k_index: (T, k) expert ids; the received rows s″ are the ids in [0, E).
        chunk: the chunk options.
        lora: this call's split-LoRA adapters (their bytes enter the memory model), or None.

    Returns:
        The :class:`ChunkPlan`: c ≥ 1, and under a budget the row-block byte target
        (:meth:`memfine.schedule.ChunkPolicy.decide`).

    Raises:
        ValueError: when the budget cannot be met and ``chunk.allow_over_budget`` is False
            (the message names the smallest feasible budget).
    """
    E = weights.shape_EDGN[0]
    recv_rows = 0  # a fixed c reads no count (no host sync)
    if chunk.memory_budget_bytes is not None:
        recv_rows = int(((top_k_index >= 0) & (top_k_index < E)).sum())
    policy = chunk_policy(module, plan, weights, top_k_index.shape[1], chunk, lora)
    return policy.plan(recv_rows, x_TD.shape[0], compute_element_size(x_TD),
                       device_type=x_TD.device.type)


def last_decision(module: nn.Module) -> ChunkDecision | None:
    """The :class:`memfine.schedule.ChunkDecision` of ``module``'s last chunked call.

    None before one, or when the module runs unchunked without a budget.
    """
    policy = getattr(module, "_memfine_chunk_policy", None)
    return None if policy is None else policy.last_decision


def run_module(module: nn.Module, plan: ExpertsPlan, weights: ExpertWeights, x_TD: torch.Tensor,
               top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, chunk: ChunkConfig,
               backend: str = "auto", index_builder: IndexBuilder = "auto",
               lora: ExpertLoRA | None = None) -> torch.Tensor:
    """The experts block over c token chunks (:func:`memfine.schedule.chunked.run_chunked`).

    Without chunk options (``num_chunks == 1``, no budget) this is one direct call; otherwise
    every chunk runs under ``checkpoint(use_reentrant=False)`` (recompute ``experts`` or
    ``full``; also at c = 1 under a budget, as the memory model assumes) or plainly (``none``,
    or when autograd is off).

    Returns:
        (T, d) in x's dtype.

    Memory: as :func:`memfine.schedule.chunked.run_chunked`: with recompute, only x_TD and the
    routing tensors are kept; backward holds one chunk's H and transients. With c > 1 on the
    fused path the chunks add their ``w_up`` / ``w_down`` gradients into one shared buffer per
    weight (:mod:`memfine.ops.weight_grads`), as the local chunk loop does; a separate up
    half (``w_up_second_EDN``) and the biases get their gradients summed by autograd. ``lora``
    (PEFT's adapters, fused path only) adds U (S_c·r) per adapter to what a chunk saves.
    """
    buffers, block_rows = None, None

    def chunk_fn(chunk: int, x_CD: torch.Tensor, top_k_index_CK: torch.Tensor,
                 top_k_weights_CK: torch.Tensor) -> torch.Tensor:
        return run_module_experts(module, plan, weights, x_CD, top_k_index_CK,
                                  top_k_weights_CK, backend=backend, index_builder=index_builder,
                                  weight_grads=buffers, lora=lora, block_rows=block_rows)

    chunked = chunk.memory_budget_bytes is not None or chunk.num_chunks > 1
    if not chunked:
        return chunk_fn(0, x_TD, top_k_index, top_k_weights)
    chunk_plan = chunk_plan_for(module, plan, weights, x_TD, top_k_index, chunk, lora)
    c, block_rows = chunk_plan.num_chunks, chunk_plan.block_rows
    if c > 1 and plan.path == "fused" and not torch.compiler.is_compiling():
        # NOTE(memory): one weight-gradient buffer per weight for all c chunks (autograd would
        # otherwise hold a chunk's gradient and the running sum at once).
        # Under torch.autocast the weights are cast once per layer call, before the sharing.
        x_TD, w_up, w_down = autocast_operands(x_TD, weights.w_up_EDG, weights.w_down_END)
        (w_up, w_down), buffers = share_weight_grads((w_up, w_down))
        weights = dataclasses.replace(weights, w_up_EDG=w_up, w_down_END=w_down)
    recompute = chunk.resolved_recompute if torch.is_grad_enabled() else "none"
    return run_chunked(chunk_fn, x_TD, top_k_index, top_k_weights, num_chunks=c,
                       recompute=recompute)
