"""Routed-expert computation over a :class:`RoutingIndex`: fused (default) or plain.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n or n.
Reference: DESIGN.md §3, §5.
"""

from __future__ import annotations

from typing import Literal

import torch

from memfine.dispatch import RoutingIndex
from memfine.ops.activations import apply_activation, check_activation
from memfine.ops.combine import combine_rows, gather_rows
from memfine.ops.fused import FusedExpertsFunction
from memfine.ops.grouped import BACKENDS
from memfine.ops.grouped_function import GroupedMatmulFunction

IMPLS = ("fused", "plain")


def check_expert_inputs(x_TD: torch.Tensor, top_k_weights: torch.Tensor,
                        index: RoutingIndex, w_up_EDG: torch.Tensor,
                        w_down_END: torch.Tensor, activation: str) -> None:
    """Validate shapes of the expert inputs; raise ValueError naming the argument.

    Raises:
        ValueError: on any shape mismatch, an unknown activation, or mixed dtypes.
    """
    check_activation(activation)
    if x_TD.dim() != 2:
        raise ValueError(f"hidden_states must be (T, d), got {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    E, k = index.num_experts, index.top_k
    if index.num_tokens != T:
        raise ValueError(f"routing index covers T={index.num_tokens} tokens, hidden_states "
                         f"has T={T}")
    if tuple(top_k_weights.shape) != (T, k):
        raise ValueError(f"top_k_weights must be (T, k)=({T}, {k}), "
                         f"got {tuple(top_k_weights.shape)}")
    if w_up_EDG.dim() != 3 or w_up_EDG.shape[:2] != (E, D):
        raise ValueError(f"w_up must be (E, d, G)=({E}, {D}, G), got {tuple(w_up_EDG.shape)}")
    G = w_up_EDG.shape[2]
    N = G // 2 if activation in ("swiglu", "geglu") else G
    if tuple(w_down_END.shape) != (E, N, D):
        raise ValueError(f"w_down must be (E, n, d)=({E}, {N}, {D}) for activation "
                         f"{activation!r} and w_up {tuple(w_up_EDG.shape)}, "
                         f"got {tuple(w_down_END.shape)}")
    if not (x_TD.dtype == w_up_EDG.dtype == w_down_END.dtype):
        raise ValueError(f"hidden_states, w_up and w_down must share a dtype, got {x_TD.dtype}, "
                         f"{w_up_EDG.dtype}, {w_down_END.dtype}")


def autocast_operands(x_TD: torch.Tensor, w_up_EDG: torch.Tensor, w_down_END: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast x and the expert weights to the autocast dtype when autocast is on for their device.

    The experts follow ``torch.autocast`` as ``nn.Linear`` does: inside a region with dtype
    bf16 (or fp16) the floating operands other than float64 are cast to it, so the grouped GEMMs
    run in bf16 and the expert path saves bf16 x and H. The cast happens here, before the
    autograd Function, whose forward and backward then see one dtype. The fp32 master weights are
    not modified; their gradients come back through the cast in fp32. Outside autocast (or for
    operands already in the autocast dtype) nothing is cast.

    Args:
        x_TD: (T, d) activations.
        w_up_EDG: (E, d, G) up-projection.
        w_down_END: (E, n, d) down-projection.

    Returns:
        ``(x_TD, w_up_EDG, w_down_END)``, cast or as given.

    Memory: the casts of the weights are new tensors ((E·d·G + E·n·d)·2 bytes for bf16) that the
    expert Function keeps for backward, as autocast's weight cache keeps the bf16 copy of an
    ``nn.Linear`` weight; bf16 parameters (``module.to(torch.bfloat16)``) need no copy.
    """
    device_type = x_TD.device.type
    if not (torch.amp.is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)):
        return x_TD, w_up_EDG, w_down_END
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t

    return cast(x_TD), cast(w_up_EDG), cast(w_down_END)


def experts_plain(x_TD: torch.Tensor, top_k_weights: torch.Tensor, index: RoutingIndex,
                  w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, activation: str = "swiglu",
                  backend: str = "auto") -> torch.Tensor:
    """Experts as most PyTorch MoE code writes them: autograd over materialised copies.

    Memory (saved for backward): gathered x (S·d), H (S·G), the activation's inputs/outputs
    (≥ S·G + S·n), Y (S·d) and the (T, k, d) gathered copy of Y in the combine.
    """
    x_SD = gather_rows(x_TD, index.expert_token_indices)
    offsets = index.expert_token_offsets
    h_SG = GroupedMatmulFunction.apply(x_SD, w_up_EDG, offsets, backend)
    a_SN = apply_activation(h_SG, activation)
    y_SD = GroupedMatmulFunction.apply(a_SN, w_down_END, offsets, backend)
    return combine_rows(y_SD, top_k_weights, index.token_index_map)


def run_experts(x_TD: torch.Tensor, top_k_weights: torch.Tensor, index: RoutingIndex,
                w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, *,
                activation: str = "swiglu", impl: Literal["fused", "plain"] = "fused",
                backend: str = "auto") -> torch.Tensor:
    """Routed experts: out[t] = Σ_j w[t,j]·act(x[t]·w_up[e])·w_down[e] with e = top_k_index[t,j].

    Args:
        x_TD: (T, d) float activations.
        top_k_weights: (T, k) routing weights (cast to x's dtype); sentinel slots ignored.
        index: the :class:`RoutingIndex` of this routing decision.
        w_up_EDG: (E, d, G) up-projection; gated activations hold [gate | up] halves (G = 2n).
        w_down_END: (E, n, d) down-projection.
        activation: ``swiglu``, ``geglu``, ``silu``, ``gelu`` or ``relu``.
        impl: ``fused`` (:class:`FusedExpertsFunction`, saves x and H) or ``plain``.
        backend: grouped GEMM backend (``auto``, ``grouped_mm``, ``loop``, ``triton``).

    Returns:
        (T, d) tensor in x's dtype (in the autocast dtype inside ``torch.autocast``, see
        :func:`autocast_operands`); rows of tokens whose slots are all sentinels are exactly 0.

    Raises:
        ValueError: on shape/dtype mismatches, an unknown impl, backend or activation.

    Memory: see :class:`FusedExpertsFunction` and :func:`experts_plain`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    x_TD, w_up_EDG, w_down_END = autocast_operands(x_TD, w_up_EDG, w_down_END)
    check_expert_inputs(x_TD, top_k_weights, index, w_up_EDG, w_down_END, activation)
    weights_TK = top_k_weights.to(x_TD.dtype)
    if impl == "plain":
        return experts_plain(x_TD, weights_TK, index, w_up_EDG, w_down_END, activation, backend)
    out: torch.Tensor = FusedExpertsFunction.apply(
        x_TD, weights_TK, w_up_EDG, w_down_END, index.expert_token_indices,
        index.expert_token_offsets, index.token_index_map, index.expert_slot_indices,
        activation, backend)
    return out
