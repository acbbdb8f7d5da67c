"""Routed experts with split LoRA adapters: checks, then the fused Function with the adapters.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n (gated) or n,
R = r (the adapters' rank).
Reference: Hu et al. 2021 (LoRA); MoEBlaze §4-§5; :mod:`memfine.lora.adapters`.
"""

from __future__ import annotations

import torch

from memfine.activations import Activation
from memfine.config.lora import check_lora_rank
from memfine.dispatch import RoutingIndex
from memfine.experts.function import FusedExpertsFunction, FusedOptions
from memfine.experts.run import autocast_operands, block_rows_of, check_expert_inputs
from memfine.lora.adapters import ExpertLoRA
from memfine.lora.quant import QuantizedBase
from memfine.ops.up_projection import UpWeights, up_parts, up_shape
from memfine.ops.weight_grads import WeightGradBuffers


def check_lora_inputs(lora: ExpertLoRA, w_up_EDG: UpWeights, w_down_END: torch.Tensor) -> None:
    """Validate the adapters against the base weights; raise ValueError naming the tensor.

    Raises:
        ValueError: when an A is given without its B (or the reverse), no adapter is given, a
            shape is not (E, r, d_in) / (E, d_out, r), A's rank differs from B's (naming
            both), the rank exceeds min(d_in, d_out), or an adapter's dtype is not the base
            weight's dtype.
    """
    E, D, G = up_shape(w_up_EDG)
    N = w_down_END.shape[1]
    base_dtype = up_parts(w_up_EDG)[0].dtype
    pairs = (("up", lora.a_up_ERD, lora.b_up_EGR, D, G),
             ("down", lora.a_down_ERN, lora.b_down_EDR, N, D))
    if all(a is None and b is None for _, a, b, _, _ in pairs):
        raise ValueError("ExpertLoRA must adapt w_up or w_down, got no adapter tensors")
    for name, a, b, d_in, d_out in pairs:
        if (a is None) != (b is None):
            raise ValueError(f"ExpertLoRA.a_{name} and b_{name} must both be given or both None")
        if a is None or b is None:
            continue
        if a.dim() != 3 or (a.shape[0], a.shape[2]) != (E, d_in):
            raise ValueError(f"ExpertLoRA.a_{name} must be (E, r, d_in)=({E}, r, {d_in}), "
                             f"got {tuple(a.shape)}")
        if b.dim() != 3 or (b.shape[0], b.shape[1]) != (E, d_out):
            raise ValueError(f"ExpertLoRA.b_{name} must be (E, d_out, r)=({E}, {d_out}, r), "
                             f"got {tuple(b.shape)}")
        r = a.shape[1]
        if b.shape[2] != r:
            raise ValueError(f"ExpertLoRA.a_{name} {tuple(a.shape)} has rank {r} while "
                             f"b_{name} {tuple(b.shape)} has rank {b.shape[2]}: A (E, r, d_in) "
                             f"and B (E, d_out, r) of one adapter must have the same r")
        check_lora_rank(r, d_in, d_out, f"LoRA rank of w_{name}")
        for t, which in ((a, "a"), (b, "b")):
            if t.dtype != base_dtype:
                raise ValueError(f"ExpertLoRA.{which}_{name} dtype must match the base weights' "
                                 f"{base_dtype}, got {t.dtype}")


def run_lora_experts(x_TD: torch.Tensor, top_k_weights: torch.Tensor, index: RoutingIndex,
                     w_up_EDG: UpWeights, w_down_END: torch.Tensor, lora: ExpertLoRA, *,
                     activation: Activation = "swiglu", backend: str = "auto",
                     b_up_EG: torch.Tensor | None = None, b_down_ED: torch.Tensor | None = None,
                     seed: int = 0,
                     block_rows: int | None = None,
                     weight_grads: WeightGradBuffers | None = None,
                     quant: QuantizedBase | None = None) -> torch.Tensor:
    """Routed experts with per-expert LoRA adapters, computed split (never W + s·B·A).

    out[t] = Σ_j w[t,j]·(act(x·W_up[e] + s·(x·A_up[e]ᵀ)·B_up[e]ᵀ + b_up[e])·W_down[e]
    + s·(A·A_down[e]ᵀ)·B_down[e]ᵀ + b_down[e]), e = e_tj (dropout on the adapter inputs).

    Args:
        x_TD: (T, d) activations (as :func:`memfine.experts.run_experts`, fused path).
        top_k_weights: (T, k) routing weights.
        index: the :class:`RoutingIndex` of this routing decision.
        w_up_EDG: (E, d, G) up-projection or its (gate, up) halves (frozen or trainable).
        w_down_END: (E, n, d) down-projection.
        lora: the adapters (:class:`memfine.lora.adapters.ExpertLoRA`), in the base dtype.
        activation: a name or a :class:`memfine.config.GatedActivation`.
        backend: grouped GEMM backend.
        b_up_EG: optional (E, G) up-projection bias.
        b_down_ED: optional (E, d) down-projection bias.
        seed: dropout masks' seed; choose it once per layer call outside recomputed regions
            (unused without dropout).
        block_rows: rows per row block of the streamed forward and backward (int ≥ 1), or None
            for the device's default (as :func:`memfine.experts.run_experts`).
        weight_grads: shared base weight-gradient buffers of a chunk loop, or None.
        quant: a frozen 4-bit base (:class:`memfine.lora.quant.QuantizedBase`, QLoRA): then
            ``w_up_EDG`` / ``w_down_END`` are its :meth:`~QuantizedBase.stand_ins` (shapes and
            dtype only) and each row block dequantises the experts it holds.

    Returns:
        (T, d) tensor in x's dtype (the autocast dtype inside ``torch.autocast``).

    Raises:
        ValueError: as :func:`memfine.experts.run_experts` and :func:`check_lora_inputs`;
            with ``quant``, when x's dtype (after autocast) is not the 4-bit base's.

    Memory: what :class:`memfine.experts.FusedExpertsFunction` saves plus, per adapter, its rank-r
    intermediate U (S·r·D_t bytes); the adapters' gradients are E·r·(d_in + d_out) elements
    each; the frozen base weights get no gradient buffer (their ``requires_grad`` is False).
    """
    check_lora_inputs(lora, w_up_EDG, w_down_END)
    n_parts = len(up_parts(w_up_EDG))
    x_TD, w_down_END, b_up_EG, b_down_ED, *rest = autocast_operands(
        x_TD, w_down_END, b_up_EG, b_down_ED, *up_parts(w_up_EDG), *lora.tensors())
    parts = tuple(rest[:n_parts])
    # NOTE(memory): adapters in a strided layout (PEFT's B is a permuted view) are copied once
    # per call (E·r·(d_in + d_out) elements): torch._grouped_mm needs dense per-expert matrices.
    lora_tensors_cast = [t.contiguous() for t in rest[n_parts:]]
    check_expert_inputs(x_TD, top_k_weights, index, parts[0] if n_parts == 1 else parts,
                        w_down_END, activation, b_up_EG, b_down_ED)
    if quant is not None and x_TD.dtype != quant.up.dtype:
        raise ValueError(f"hidden_states must have the 4-bit base weights' dtype "
                         f"{quant.up.dtype} (they dequantise to it), got {x_TD.dtype}")
    G = sum(p.shape[2] for p in parts)
    rows = block_rows_of(block_rows, x_TD, w_down_END.shape[1], G)
    options = FusedOptions(activation=activation, backend=backend, block_rows=rows,
                           weight_grads=weight_grads, host_offsets=index.host_offsets,
                           lora=lora.spec(seed),
                           quant=None if quant is None else quant.windowed(rows))
    # a 4-bit base is read from the options (its stand-ins are not passed)
    base = (parts[0], w_down_END) if quant is None else (None, None)
    out: torch.Tensor = FusedExpertsFunction.apply(
        options, x_TD, top_k_weights.to(x_TD.dtype), index.expert_token_indices,
        index.expert_token_offsets, index.token_index_map, index.expert_slot_indices,
        *base, b_up_EG, b_down_ED, parts[1] if len(parts) == 2 else None,
        *lora_tensors_cast)
    return out
