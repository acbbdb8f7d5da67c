"""The MoEBlaze fused expert Function, saving only x and H.

One Function runs gather → up-projection (+ bias) → activation → down-projection (+ bias) →
weighted combine.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n (gated) or n.
Reference: MoEBlaze (arXiv 2601.05296) §4-§5 (buffer-free dispatch, smart checkpointing);
docs/design.md §3, §5; docs/style.md §9.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.ops.activations import Activation, activation_backward, apply_activation
from memfine.ops.combine import combine_rows, gather_rows, reduce_rows, scatter_slots
from memfine.ops.grouped import grouped_mm, grouped_row_sums, grouped_weight_grad
from memfine.ops.up_projection import up_input_grad, up_project, up_weight_grads

# Activations the Triton up-projection kernel computes in its epilogue.
TRITON_EPILOGUE_ACTIVATIONS = ("swiglu", "geglu", "silu", "gelu", "relu")


def _row_dots(a_SN: torch.Tensor, b_SN: torch.Tensor) -> torch.Tensor:
    """(S,) per-row inner products ⟨a_r, b_r⟩ without an (S, n) product temporary."""
    return torch.bmm(a_SN.unsqueeze(1), b_SN.unsqueeze(2)).view(-1)


def expert_of_rows(offsets_E1: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(S,) int64 expert id of every expert-grouped row, from expert_token_offsets (E + 1,)."""
    E = offsets_E1.shape[0] - 1
    counts_E = (offsets_E1[1:] - offsets_E1[:-1]).long()
    return torch.repeat_interleave(torch.arange(E, device=offsets_E1.device), counts_E,
                                   output_size=num_rows)


def _add_row_bias_(rows_SO: torch.Tensor, bias_EO: torch.Tensor | None,
                   offsets_E1: torch.Tensor) -> torch.Tensor:
    """rows[r] += bias[expert of r] in place (no-op without a bias); returns rows."""
    if bias_EO is None:
        return rows_SO
    expert_S = expert_of_rows(offsets_E1, rows_SO.shape[0])
    # NOTE(memory): the (S, O) gathered bias is transient; only the parameter is saved.
    return rows_SO.add_(bias_EO.index_select(0, expert_S))


def _forward_triton(x_TD: torch.Tensor, weights_TK: torch.Tensor, w_up_EDG: torch.Tensor,
                    w_down_END: torch.Tensor, expert_token_indices_S: torch.Tensor,
                    offsets_E1: torch.Tensor, token_index_map_TK: torch.Tensor,
                    expert_slot_indices_S: torch.Tensor, activation: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, out) computed with the Triton kernels.

    The gather is fused into the up-projection with the activation in its epilogue, the routing
    weight is applied in the down-projection's epilogue, then a per-token combine sums the rows.
    """
    from memfine.ops.triton import down_combine, gather_up

    h_SG, a_SN = gather_up(x_TD, w_up_EDG, expert_token_indices_S, offsets_E1, activation)
    w_S = weights_TK.reshape(-1).index_select(0, expert_slot_indices_S.long())
    return h_SG, down_combine(a_SN, w_down_END, offsets_E1, w_S, token_index_map_TK)


def _forward_rows(x_TD: torch.Tensor, weights_TK: torch.Tensor,
                  up_parts: tuple[torch.Tensor, ...], w_down_END: torch.Tensor,
                  b_up_EG: torch.Tensor | None, b_down_ED: torch.Tensor | None,
                  token_idx_S: torch.Tensor,
                  offsets_E1: torch.Tensor, map_TK: torch.Tensor, activation: Activation,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, out) with the grouped GEMM backend; the per-row biases are added in place.

    ``up_parts``: the up-projection as one (E, d, G) tensor or its (gate, up) halves.
    """
    x_SD = gather_rows(x_TD, token_idx_S)
    h_SG = _add_row_bias_(up_project(x_SD, up_parts, offsets_E1, backend), b_up_EG, offsets_E1)
    del x_SD  # NOTE(memory): the gathered copy is never saved (saves S·d·D_t bytes)
    a_SN = apply_activation(h_SG, activation)
    y_SD = grouped_mm(a_SN, w_down_END, offsets_E1, backend)
    del a_SN  # NOTE(memory): A is recomputed from H in backward (saves S·n·D_t bytes)
    out_TD = combine_rows(_add_row_bias_(y_SD, b_down_ED, offsets_E1), weights_TK, map_TK)
    del y_SD  # NOTE(memory): Y is never saved (saves S·d·D_t bytes)
    return h_SG, out_TD


class FusedExpertsFunction(torch.autograd.Function):
    """Routed experts with minimal saved activations.

    forward(x_TD, weights_TK, w_up_EDG, w_down_END, b_up_EG, b_down_ED, expert_token_indices_S,
    expert_token_offsets_E1, token_index_map_TK, expert_slot_indices_S, activation, backend)
    → out_TD (T, d) with out[t] = Σ_j w[t,j] · (act(x[t]·w_up[e] + b_up[e])·w_down[e] + b_down[e]),
    e = e_tj. ``b_up_EG`` (E, G) and ``b_down_ED`` (E, d) are optional (None: no bias);
    ``activation`` is a name or a :class:`memfine.ops.activations.GatedActivation` (e.g. GPT-OSS's
    clamped, interleaved SwiGLU).

    ``w_up_second_EDN`` (E, d, n), the last input, is None or the up half of a gated
    up-projection held as its own tensor; ``w_up_EDG`` is then the (E, d, n) gate half and
    H = [x·w_up | x·w_up_second], exactly as if the two were one concatenated tensor
    (torchtitan's separate ``w1``/``w3``; :mod:`memfine.ops.up_projection`). With two halves the
    Triton path runs its grouped GEMM per half, not the fused gather-up kernel.

    Saved for backward (D_t = bytes per element of x):
        - x_TD: T·d·D_t bytes (the layer input, never a gathered copy);
        - h_SG: S·G·D_t bytes (pre-activation, bias included; G = 2n for gated activations,
          n for GELU/ReLU/SiLU);
        - weights_TK: T·k·D_t bytes (routing weights, already in x's dtype);
        - the int32 index arrays expert_token_indices (S), expert_slot_indices (S),
          token_index_map (T·k), expert_token_offsets (E + 1): 4·(2·S + T·k + E + 1) bytes;
        - w_up, w_down and the biases: parameters, not activations (no extra bytes; a bias
          adds no saved activation).
        Total activation bytes: (T·d + S·G + T·k)·D_t + 4·(2·S + T·k + E + 1); with S = T·k and
        a gated activation that is the no-recompute floor (T·d + 2·T·k·n) elements
        (docs/design.md §5) plus the weights and indices. Not kept: the gathered x (S·d), A (S·n),
        Y (S·d), the (T, k, d) scattered copy, the per-row biases.

    Recomputed in backward:
        the gathered rows x[expert_token_indices] and dO[expert_token_indices] (S·d each) and
        A = act(H) (S·n). The routing-weight gradient is
        dw_(t,j) = ⟨dO_t·w_downᵀ, A_r⟩ + ⟨dO_t, b_down[e]⟩, so Y is never needed. dx is reduced
        per token through token_index_map (deterministic, no atomics). The bias gradients are
        per-expert segment sums: db_up[e] = Σ_{rows of e} dH_r, db_down[e] = Σ_{rows of e} w_r·dO_t.

    With ``backend="triton"``, a named activation and no biases, the forward gathers x inside the
    up-projection kernel (SwiGLU or the plain activation in its epilogue) and applies the routing
    weights in the down-projection epilogue before a per-token combine kernel; otherwise the
    Triton grouped GEMM runs the same steps as the other backends.

    Backward transients (freed as soon as used): dO rows (S·d), dA (S·n), A (S·n), dH (S·G),
    gathered x (S·d), dx rows (S·d), the (T, k, d) per-token gather and, with a down bias, its
    (S, d) rows.
    """

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, weights_TK: torch.Tensor, w_up_EDG: torch.Tensor,
                w_down_END: torch.Tensor, b_up_EG: torch.Tensor | None,
                b_down_ED: torch.Tensor | None, expert_token_indices_S: torch.Tensor,
                expert_token_offsets_E1: torch.Tensor, token_index_map_TK: torch.Tensor,
                expert_slot_indices_S: torch.Tensor, activation: Activation, backend: str,
                w_up_second_EDN: torch.Tensor | None = None) -> torch.Tensor:
        """Compute out_TD (T, d) in x's dtype; save x, H, routing weights, weights, indices.

        Arguments, saved tensors and their bytes are described on the class.
        """
        parts = (w_up_EDG,) if w_up_second_EDN is None else (w_up_EDG, w_up_second_EDN)
        no_bias = b_up_EG is None and b_down_ED is None
        if (backend == "triton" and no_bias and activation in TRITON_EPILOGUE_ACTIVATIONS
                and len(parts) == 1):
            h_SG, out_TD = _forward_triton(x_TD, weights_TK, w_up_EDG, w_down_END,
                                           expert_token_indices_S, expert_token_offsets_E1,
                                           token_index_map_TK, expert_slot_indices_S, activation)
        else:
            h_SG, out_TD = _forward_rows(x_TD, weights_TK, parts, w_down_END, b_up_EG,
                                         b_down_ED, expert_token_indices_S,
                                         expert_token_offsets_E1, token_index_map_TK,
                                         activation, backend)
        # NOTE(memory): saves x (T·d) + H (S·G) + weights (T·k) elements + int32 indices only;
        # the biases are parameters (saved by reference, no activation bytes).
        ctx.save_for_backward(x_TD, h_SG, weights_TK, w_up_EDG, w_down_END, b_up_EG, b_down_ED,
                              expert_token_indices_S, expert_token_offsets_E1,
                              token_index_map_TK, expert_slot_indices_S, *parts[1:])
        ctx.activation, ctx.backend = activation, backend
        return out_TD

    @staticmethod
    def backward(ctx: Any, grad_out_TD: torch.Tensor) -> tuple[Any, ...]:
        """Gradients of x, the routing weights, w_up, w_down and the biases from dO (T, d).

        Recomputes the gathered rows and A from the saved H; a gradient whose input does not
        need one is None, as are the entries of the index arrays, activation and backend.
        """
        (x_TD, h_SG, weights_TK, w_up_EDG, w_down_END, b_up_EG, b_down_ED, token_idx_S,
         offsets_E1, map_TK, slot_S, *second) = ctx.saved_tensors
        parts = (w_up_EDG, *second)
        act, backend = ctx.activation, ctx.backend
        need_x, need_w, need_up, need_down, need_b_up, need_b_down = ctx.needs_input_grad[:6]
        need_up_second = len(parts) == 2 and ctx.needs_input_grad[12]
        E = w_up_EDG.shape[0]
        w_S1 = weights_TK.reshape(-1).index_select(0, slot_S.long())[:, None]
        grad_out_SD = gather_rows(grad_out_TD.contiguous(), token_idx_S)  # transient S·d
        grad_a_SN = grouped_mm(grad_out_SD, w_down_END.transpose(1, 2), offsets_E1, backend)
        grad_weights = grad_down = grad_b_down = None
        a_SN = apply_activation(h_SG, act) if need_w or need_down else None  # transient S·n
        if need_w:  # ⟨dO·w_downᵀ, A⟩ (+ ⟨dO, b_down⟩) (MoEBlaze §5): Y is not needed
            assert a_SN is not None, "A is recomputed when the weights need a gradient"
            dots_S = _row_dots(grad_a_SN, a_SN)
            if b_down_ED is not None:
                bias_SD = b_down_ED.index_select(0, expert_of_rows(offsets_E1, len(slot_S)))
                dots_S += _row_dots(grad_out_SD, bias_SD)
            grad_weights = scatter_slots(dots_S, slot_S, tuple(weights_TK.shape))
            del dots_S
        if need_down or need_b_down:
            grad_out_SD.mul_(w_S1)  # (w ⊙ dO) rows
            if need_down:  # dW_down[e] = A_eᵀ · (w ⊙ dO)_e
                grad_down = grouped_weight_grad(a_SN, grad_out_SD, offsets_E1, E, backend,
                                                like=w_down_END)
            if need_b_down:  # db_down[e] = Σ_{rows of e} (w ⊙ dO)
                grad_b_down = grouped_row_sums(grad_out_SD, offsets_E1, E)
        del a_SN, grad_out_SD
        grad_h_SG = activation_backward(h_SG, grad_a_SN.mul_(w_S1), act)
        del grad_a_SN
        grad_b_up = grouped_row_sums(grad_h_SG, offsets_E1, E) if need_b_up else None
        grad_x = None
        grad_ups: list[Any] = [None] * len(parts)
        if need_up or need_up_second:
            x_SD = gather_rows(x_TD, token_idx_S)  # NOTE(memory): recomputed gather, S·d
            grad_ups = up_weight_grads(x_SD, grad_h_SG, parts, offsets_E1, E, backend)
            del x_SD
        if need_x:
            grad_x_SD = up_input_grad(grad_h_SG, parts, offsets_E1, backend)
            grad_x = reduce_rows(grad_x_SD, map_TK)  # per-token sum: no atomics
        grad_up_second = grad_ups[1] if len(parts) == 2 else None
        # None: expert_token_indices, expert_token_offsets, token_index_map,
        # expert_slot_indices, activation, backend
        return (grad_x, grad_weights, grad_ups[0], grad_down, grad_b_up, grad_b_down,
                None, None, None, None, None, None, grad_up_second)
