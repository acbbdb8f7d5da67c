"""Routed-expert computation over a :class:`RoutingIndex`: fused (default) or plain.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n or n.
Reference: docs/design.md §3, §5.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from memfine.activations import Activation, apply_activation, check_activation, is_gated
from memfine.config import backward_block_rows
from memfine.dispatch import RoutingIndex
from memfine.experts.function import FusedExpertsFunction, FusedOptions, expert_of_rows
from memfine.ops.combine import combine_rows, gather_rows
from memfine.ops.grouped import BACKENDS
from memfine.ops.grouped_function import GroupedMatmulFunction
from memfine.ops.up_projection import UpWeights, up_parts, up_shape
from memfine.ops.weight_grads import WeightGradBuffers

IMPLS = ("fused", "plain")


def check_expert_inputs(x_TD: torch.Tensor, top_k_weights: torch.Tensor,
                        index: RoutingIndex, w_up_EDG: UpWeights,
                        w_down_END: torch.Tensor, activation: Activation,
                        b_up_EG: torch.Tensor | None = None,
                        b_down_ED: torch.Tensor | None = None) -> None:
    """Validate shapes of the expert inputs; raise ValueError naming the argument.

    ``w_up_EDG`` is one (E, d, G) tensor or a (gate, up) pair of (E, d, n) halves.

    Raises:
        ValueError: on any shape mismatch (biases included), an unknown activation, mixed
            dtypes, or a pair of halves with a non-gated activation.
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
    parts = up_parts(w_up_EDG)
    if any(p.dim() != 3 or p.shape[:2] != (E, D) for p in parts):
        raise ValueError(f"w_up must be (E, d, G)=({E}, {D}, G) or two (E, d, n) halves, got "
                         f"{[tuple(p.shape) for p in parts]}")
    if len(parts) == 2 and not is_gated(activation):
        raise ValueError(f"w_up given as (gate, up) halves needs a gated activation, got "
                         f"{activation!r}")
    G = up_shape(w_up_EDG)[2]
    N = G // 2 if is_gated(activation) else G
    if tuple(w_down_END.shape) != (E, N, D):
        raise ValueError(f"w_down must be (E, n, d)=({E}, {N}, {D}) for activation "
                         f"{activation!r} and w_up (E, d, G)={(E, D, G)}, "
                         f"got {tuple(w_down_END.shape)}")
    if not (x_TD.dtype == parts[0].dtype == w_down_END.dtype):
        raise ValueError(f"hidden_states, w_up and w_down must share a dtype, got {x_TD.dtype}, "
                         f"{parts[0].dtype}, {w_down_END.dtype}")
    for name, bias, shape in (("b_up", b_up_EG, (E, G)), ("b_down", b_down_ED, (E, D))):
        if bias is None:
            continue
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {'(E, G)' if name == 'b_up' else '(E, d)'}="
                             f"{shape}, got {tuple(bias.shape)}")
        if bias.dtype != x_TD.dtype:
            raise ValueError(f"{name} must have hidden_states' dtype {x_TD.dtype}, "
                             f"got {bias.dtype}")


def compute_element_size(x_TD: torch.Tensor) -> int:
    """D_t of the expert path for activations ``x_TD``: bytes per element it computes in.

    Under ``torch.autocast`` on x's device, the autocast dtype's size for floating x other
    than float64 (:func:`autocast_operands` casts to it); otherwise x's own element size. The
    chunk policy sizes its memory model and row blocks with it.
    """
    device_type = x_TD.device.type
    if (x_TD.is_floating_point() and x_TD.dtype != torch.float64
            and torch.amp.is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)):
        return torch.get_autocast_dtype(device_type).itemsize
    return x_TD.element_size()


def autocast_operands(x_TD: torch.Tensor, *operands: torch.Tensor | None
                      ) -> tuple[Any, ...]:
    """Cast x and the expert weights to the autocast dtype when autocast is on for their device.

    The experts follow ``torch.autocast`` as ``nn.Linear`` does: inside a region with dtype
    bf16 (or fp16) the floating operands other than float64 are cast to it, so the grouped GEMMs
    run in bf16 and the expert path saves bf16 x and H. The cast happens here, before the
    autograd Function, whose forward and backward then see one dtype. The fp32 master weights are
    not modified; their gradients come back through the cast in fp32. Outside autocast (or for
    operands already in the autocast dtype) nothing is cast.

    Args:
        x_TD: (T, d) activations; its device selects the autocast state.
        *operands: the expert weights and biases (``w_up`` (E, d, G), ``w_down`` (E, n, d),
            optional biases; None passes through).

    Returns:
        ``(x_TD, *operands)``, cast or as given.

    Memory: the casts of the weights are new tensors ((E·d·G + E·n·d)·2 bytes for bf16) that the
    expert Function keeps for backward, as autocast's weight cache keeps the bf16 copy of an
    ``nn.Linear`` weight; bf16 parameters (``module.to(torch.bfloat16)``) need no copy.
    """
    device_type = x_TD.device.type
    if not (torch.amp.is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)):
        return (x_TD, *operands)
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(dtype)

    return (cast(x_TD), *(cast(t) for t in operands))


def experts_plain(x_TD: torch.Tensor, top_k_weights: torch.Tensor, index: RoutingIndex,
                  w_up_EDG: UpWeights, w_down_END: torch.Tensor,
                  activation: Activation = "swiglu", backend: str = "auto",
                  b_up_EG: torch.Tensor | None = None,
                  b_down_ED: torch.Tensor | None = None) -> torch.Tensor:
    """Experts as most PyTorch MoE code writes them: autograd over materialised copies.

    Memory (saved for backward): gathered x (S·d), H (S·G), the activation's inputs/outputs
    (≥ S·G + S·n), Y (S·d) and the (T, k, d) gathered copy of Y in the combine (plus the
    per-row bias indices with biases).
    """
    x_SD = gather_rows(x_TD, index.expert_token_indices)
    offsets = index.expert_token_offsets
    h_SG = grouped_up_projection(x_SD, w_up_EDG, offsets, backend)
    if b_up_EG is not None:
        h_SG = h_SG + b_up_EG.index_select(0, expert_of_rows(offsets, index.num_rows))
    a_SN = apply_activation(h_SG, activation)
    y_SD = GroupedMatmulFunction.apply(a_SN, w_down_END, offsets, backend)
    if b_down_ED is not None:
        y_SD = y_SD + b_down_ED.index_select(0, expert_of_rows(offsets, index.num_rows))
    return combine_rows(y_SD, top_k_weights, index.token_index_map)


def grouped_up_projection(x_SD: torch.Tensor, w_up_EDG: UpWeights, offsets_E1: torch.Tensor,
                          backend: str = "auto") -> torch.Tensor:
    """H (S, G) = grouped x·w_up with autograd; a (gate, up) pair gives [x·w_gate | x·w_up].

    Memory (saved for backward): x_SD once per part (the same storage) and the offsets.
    """
    parts = up_parts(w_up_EDG)
    if len(parts) == 1:
        return GroupedMatmulFunction.apply(x_SD, parts[0], offsets_E1, backend)
    return torch.cat([GroupedMatmulFunction.apply(x_SD, p, offsets_E1, backend) for p in parts],
                     dim=1)


def _check_run_options(impl: str, backend: str) -> None:
    """Raise ValueError naming ``impl`` or ``backend`` when invalid."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def block_rows_of(block_rows: int | None, x_TD: torch.Tensor, N: int, G: int) -> int:
    """Rows per block of a fused call: ``block_rows``, or for None the device's default.

    None: :func:`memfine.config.backward_block_rows` of the default block at x's d, n, G,
    element size and device (a call made without a layer's plan).

    Raises:
        ValueError: naming ``block_rows`` when it is not None or an int ≥ 1.
    """
    if block_rows is None:
        return backward_block_rows(None, x_TD.shape[1], N, G, x_TD.element_size(),
                                   x_TD.device.type)
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be None (the device's default) or an int >= 1, "
                         f"got {block_rows!r}")
    return block_rows


def run_experts(x_TD: torch.Tensor, top_k_weights: torch.Tensor, index: RoutingIndex,
                w_up_EDG: UpWeights, w_down_END: torch.Tensor, *,
                activation: Activation = "swiglu", impl: Literal["fused", "plain"] = "fused",
                backend: str = "auto", b_up_EG: torch.Tensor | None = None,
                b_down_ED: torch.Tensor | None = None,
                block_rows: int | None = None,
                weight_grads: WeightGradBuffers | None = None) -> torch.Tensor:
    """Routed experts: out[t] = Σ_j w[t,j]·(act(x[t]·w_up[e] + b_up[e])·w_down[e] + b_down[e]).

    e = top_k_index[t, j]; the biases are optional (None: no bias).

    Args:
        x_TD: (T, d) float activations.
        top_k_weights: (T, k) routing weights (cast to x's dtype); sentinel slots ignored.
        index: the :class:`RoutingIndex` of this routing decision.
        w_up_EDG: (E, d, G) up-projection; gated activations hold [gate | up] halves (G = 2n).
            A gated up-projection may also be given as a (gate, up) pair of (E, d, n) tensors
            (kept apart, never concatenated; :mod:`memfine.ops.up_projection`).
        w_down_END: (E, n, d) down-projection.
        activation: ``swiglu``, ``geglu``, ``silu``, ``gelu``, ``relu`` or a
            :class:`memfine.config.GatedActivation` (e.g. GPT-OSS's clamped SwiGLU).
        impl: ``fused`` (:class:`FusedExpertsFunction`, saves x and H) or ``plain``.
        backend: grouped GEMM backend (``auto``, ``grouped_mm``, ``loop``, ``triton``).
        b_up_EG: optional (E, G) up-projection bias in x's dtype (the gate and up columns, in
            the activation's layout).
        b_down_ED: optional (E, d) down-projection bias in x's dtype.
        block_rows: fused path: rows per row block of the streamed forward and backward, an
            int ≥ 1 (a layer passes its plan's, :class:`memfine.schedule.ChunkPlan`), or None
            for the device's default block (:func:`memfine.config.backward_block_rows` of
            None: :func:`memfine.config.default_block_bytes`, at least
            :data:`memfine.config.MIN_BLOCK_ROWS` rows).
        weight_grads: fused path: shared weight-gradient buffers of a chunk loop
            (:func:`memfine.ops.weight_grads.share_weight_grads`); ``None``: the Function
            returns its own.

    Returns:
        (T, d) tensor in x's dtype (in the autocast dtype inside ``torch.autocast``, see
        :func:`autocast_operands`); rows of tokens whose slots are all sentinels are exactly 0.

    Raises:
        ValueError: on shape/dtype mismatches, an unknown impl, backend or activation.

    Memory: see :class:`FusedExpertsFunction` and :func:`experts_plain`.
    """
    _check_run_options(impl, backend)
    x_TD, w_down_END, b_up_EG, b_down_ED, *ups = autocast_operands(
        x_TD, w_down_END, b_up_EG, b_down_ED, *up_parts(w_up_EDG))
    w_up_EDG = ups[0] if len(ups) == 1 else (ups[0], ups[1])
    check_expert_inputs(x_TD, top_k_weights, index, w_up_EDG, w_down_END, activation,
                        b_up_EG, b_down_ED)
    weights_TK = top_k_weights.to(x_TD.dtype)
    if impl == "plain":
        return experts_plain(x_TD, weights_TK, index, w_up_EDG, w_down_END, activation, backend,
                             b_up_EG, b_down_ED)
    parts = up_parts(w_up_EDG)
    G = sum(p.shape[2] for p in parts)
    options = FusedOptions(activation=activation, backend=backend,
                           block_rows=block_rows_of(block_rows, x_TD, w_down_END.shape[1], G),
                           weight_grads=weight_grads, host_offsets=index.host_offsets)
    out: torch.Tensor = FusedExpertsFunction.apply(
        options, x_TD, weights_TK, index.expert_token_indices, index.expert_token_offsets,
        index.token_index_map, index.expert_slot_indices,
        parts[0], w_down_END, b_up_EG, b_down_ED, parts[1] if len(parts) == 2 else None)
    return out
