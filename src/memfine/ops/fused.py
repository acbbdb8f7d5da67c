"""The MoEBlaze fused expert Function, saving only x and H.

One Function runs gather → up-projection → activation → down-projection → weighted combine.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n (gated) or n.
Reference: MoEBlaze (arXiv 2601.05296) §4-§5 (buffer-free dispatch, smart checkpointing);
docs/design.md §3, §5; docs/style.md §9.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.ops.activations import activation_backward, apply_activation
from memfine.ops.combine import combine_rows, gather_rows, reduce_rows, scatter_slots
from memfine.ops.grouped import grouped_mm, grouped_weight_grad


def _row_dots(a_SN: torch.Tensor, b_SN: torch.Tensor) -> torch.Tensor:
    """(S,) per-row inner products ⟨a_r, b_r⟩ without an (S, n) product temporary."""
    return torch.bmm(a_SN.unsqueeze(1), b_SN.unsqueeze(2)).view(-1)


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


class FusedExpertsFunction(torch.autograd.Function):
    """Routed experts with minimal saved activations.

    forward(x_TD, weights_TK, w_up_EDG, w_down_END, expert_token_indices_S,
    expert_token_offsets_E1, token_index_map_TK, expert_slot_indices_S, activation, backend)
    → out_TD (T, d) with out[t] = Σ_j w[t,j] · act(x[t]·w_up[e_tj])·w_down[e_tj].

    Saved for backward (D_t = bytes per element of x):
        - x_TD: T·d·D_t bytes (the layer input, never a gathered copy);
        - h_SG: S·G·D_t bytes (pre-activation; G = 2n for SwiGLU/GeGLU, n for GELU/ReLU/SiLU);
        - weights_TK: T·k·D_t bytes (routing weights, already in x's dtype);
        - the int32 index arrays expert_token_indices (S), expert_slot_indices (S),
          token_index_map (T·k), expert_token_offsets (E + 1): 4·(2·S + T·k + E + 1) bytes;
        - w_up, w_down: parameters, not activations (no extra bytes).
        Total activation bytes: (T·d + S·G + T·k)·D_t + 4·(2·S + T·k + E + 1); with S = T·k and
        SwiGLU that is the no-recompute floor (T·d + 2·T·k·n) elements (docs/design.md §5) plus the
        weights and indices. Not kept: the gathered x (S·d), A (S·n), Y (S·d), the (T, k, d)
        scattered copy.

    Recomputed in backward:
        the gathered rows x[expert_token_indices] and dO[expert_token_indices] (S·d each) and
        A = act(H) (S·n). The routing-weight gradient is dw_(t,j) = ⟨dO_t·w_downᵀ, A_r⟩, so Y is
        never needed. dx is reduced per token through token_index_map (deterministic, no atomics).

    With ``backend="triton"`` the forward gathers x inside the up-projection kernel (SwiGLU or
    the plain activation in its epilogue) and applies the routing weights in the down-projection
    epilogue before a per-token combine kernel; the backward uses the Triton grouped GEMM.

    Backward transients (freed as soon as used): dO rows (S·d), dA (S·n), A (S·n), dH (S·G),
    gathered x (S·d), dx rows (S·d) and the (T, k, d) per-token gather.
    """

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, weights_TK: torch.Tensor, w_up_EDG: torch.Tensor,
                w_down_END: torch.Tensor, expert_token_indices_S: torch.Tensor,
                expert_token_offsets_E1: torch.Tensor, token_index_map_TK: torch.Tensor,
                expert_slot_indices_S: torch.Tensor, activation: str, backend: str
                ) -> torch.Tensor:
        """Compute out_TD (T, d) in x's dtype; save x, H, routing weights, w_up, w_down, indices.

        Arguments, saved tensors and their bytes are described on the class.
        """
        if backend == "triton":
            h_SG, out_TD = _forward_triton(x_TD, weights_TK, w_up_EDG, w_down_END,
                                           expert_token_indices_S, expert_token_offsets_E1,
                                           token_index_map_TK, expert_slot_indices_S, activation)
        else:
            x_SD = gather_rows(x_TD, expert_token_indices_S)
            h_SG = grouped_mm(x_SD, w_up_EDG, expert_token_offsets_E1, backend)
            del x_SD  # NOTE(memory): the gathered copy is never saved (saves S·d·D_t bytes)
            a_SN = apply_activation(h_SG, activation)
            y_SD = grouped_mm(a_SN, w_down_END, expert_token_offsets_E1, backend)
            del a_SN  # NOTE(memory): A is recomputed from H in backward (saves S·n·D_t bytes)
            out_TD = combine_rows(y_SD, weights_TK, token_index_map_TK)
            del y_SD  # NOTE(memory): Y is never saved (saves S·d·D_t bytes)
        # NOTE(memory): saves x (T·d) + H (S·G) + weights (T·k) elements + int32 indices only.
        ctx.save_for_backward(x_TD, h_SG, weights_TK, w_up_EDG, w_down_END,
                              expert_token_indices_S, expert_token_offsets_E1,
                              token_index_map_TK, expert_slot_indices_S)
        ctx.activation, ctx.backend = activation, backend
        return out_TD

    @staticmethod
    def backward(ctx: Any, grad_out_TD: torch.Tensor) -> tuple[Any, ...]:
        """Gradients of x, the routing weights, w_up and w_down from dO (T, d).

        Recomputes the gathered rows and A from the saved H; a gradient whose input does not
        need one is None, as are the entries of the index arrays, activation and backend.
        """
        (x_TD, h_SG, weights_TK, w_up_EDG, w_down_END, token_idx_S, offsets_E1, map_TK,
         slot_S) = ctx.saved_tensors
        act, backend = ctx.activation, ctx.backend
        need_x, need_w, need_up, need_down = ctx.needs_input_grad[:4]
        E = w_up_EDG.shape[0]
        w_S1 = weights_TK.reshape(-1).index_select(0, slot_S.long())[:, None]
        grad_out_SD = gather_rows(grad_out_TD.contiguous(), token_idx_S)  # transient S·d
        grad_a_SN = grouped_mm(grad_out_SD, w_down_END.transpose(1, 2), offsets_E1, backend)
        grad_weights = grad_down = None
        if need_w or need_down:
            a_SN = apply_activation(h_SG, act)  # NOTE(memory): recomputed, transient S·n
            if need_w:  # ⟨dO·w_downᵀ, A⟩ (MoEBlaze §5): Y is not needed
                grad_weights = scatter_slots(_row_dots(grad_a_SN, a_SN), slot_S,
                                             tuple(weights_TK.shape))
            if need_down:  # dW_down[e] = A_eᵀ · (w ⊙ dO)_e
                grad_down = grouped_weight_grad(a_SN, grad_out_SD.mul_(w_S1), offsets_E1, E,
                                                backend, like=w_down_END)
            del a_SN
        del grad_out_SD
        grad_h_SG = activation_backward(h_SG, grad_a_SN.mul_(w_S1), act)
        del grad_a_SN
        grad_x = grad_up = None
        if need_up:
            x_SD = gather_rows(x_TD, token_idx_S)  # NOTE(memory): recomputed gather, S·d
            grad_up = grouped_weight_grad(x_SD, grad_h_SG, offsets_E1, E, backend,
                                          like=w_up_EDG)
            del x_SD
        if need_x:
            grad_x_SD = grouped_mm(grad_h_SG, w_up_EDG.transpose(1, 2), offsets_E1, backend)
            grad_x = reduce_rows(grad_x_SD, map_TK)  # per-token sum: no atomics
        # None: expert_token_indices, expert_token_offsets, token_index_map,
        # expert_slot_indices, activation, backend
        return grad_x, grad_weights, grad_up, grad_down, None, None, None, None, None, None
