"""Autograd over one grouped GEMM, for the plain (non-fused) expert path.

Legend: S routed rows, E experts, I input features, O output features.
"""

from __future__ import annotations

from typing import Any

import torch

from memfine.ops.grouped import grouped_mm, grouped_weight_grad


class GroupedMatmulFunction(torch.autograd.Function):
    """Y = grouped X·W[e] with a backward that works on every backend.

    ``torch._grouped_mm``'s own backward rejects non-contiguous incoming gradients; this Function
    makes them contiguous and uses the same backend for dX and dW.

    Saved for backward: x_SI (S·I elements) and the offsets; W is a parameter (not an activation).
    Recomputed in backward: nothing.
    """

    @staticmethod
    def forward(ctx: Any, x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor,
                backend: str) -> torch.Tensor:
        """Y (S, O) = X[rows of e] · W[e] for every expert e; save X, W and the offsets."""
        ctx.save_for_backward(x_SI, w_EIO, offsets_E1)
        ctx.backend = backend
        return grouped_mm(x_SI, w_EIO, offsets_E1, backend)

    @staticmethod
    def backward(ctx: Any, grad_y_SO: torch.Tensor) -> tuple[Any, ...]:
        """Compute dX = dY · W[e]ᵀ and dW[e] = X_eᵀ · dY_e (each only if needed), same backend.

        None for offsets_E1 and backend.
        """
        x_SI, w_EIO, offsets_E1 = ctx.saved_tensors
        grad_y_SO = grad_y_SO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad_y_SO, w_EIO.transpose(1, 2), offsets_E1, ctx.backend)
        if ctx.needs_input_grad[1]:
            grad_w = grouped_weight_grad(x_SI, grad_y_SO, offsets_E1, w_EIO.shape[0],
                                         ctx.backend, like=w_EIO)
        return grad_x, grad_w, None, None  # None: offsets_E1, backend
