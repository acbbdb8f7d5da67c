"""Expert activations on the pre-activation H and their backward, recomputed from H.

Legend: S routed rows, G = 2n (gated) or n columns of H, N = n.
Gated layout: H = [gate | up] (gate in columns [0, n), up in [n, 2n)); A = act(gate) ⊙ up.
Reference: DESIGN.md §1 (SwiGLU experts), MoEBlaze §4 (activation recomputed from H).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfine.config import GATED_ACTIVATIONS

_ELEMENTWISE = {
    "silu": F.silu,
    "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
}
_GATE = {"swiglu": "silu", "geglu": "gelu"}


def check_activation(activation: str) -> None:
    """Raise ValueError for an unknown activation name."""
    if activation not in _GATE and activation not in _ELEMENTWISE:
        allowed = sorted([*_GATE, *_ELEMENTWISE])
        raise ValueError(f"activation must be one of {allowed}, got {activation!r}")


def apply_activation(h_SG: torch.Tensor, activation: str) -> torch.Tensor:
    """A = act(H): (S, 2n) → (S, n) for gated activations, (S, n) → (S, n) otherwise.

    Raises:
        ValueError: for an unknown activation, or an odd width with a gated one.
    """
    check_activation(activation)
    if activation in GATED_ACTIVATIONS:
        if h_SG.shape[-1] % 2:
            raise ValueError(f"gated activation {activation!r} needs an even H width, "
                             f"got {h_SG.shape[-1]}")
        gate_SN, up_SN = h_SG.chunk(2, dim=-1)
        return _ELEMENTWISE[_GATE[activation]](gate_SN) * up_SN
    return _ELEMENTWISE[activation](h_SG)


def activation_backward(h_SG: torch.Tensor, grad_a_SN: torch.Tensor, activation: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute A from H and return (A, dH).

    Args:
        h_SG: (S, G) saved pre-activation.
        grad_a_SN: (S, n) gradient of the loss w.r.t. A.
        activation: activation name.

    Returns:
        ``(a_SN, grad_h_SG)``; both transient (freed by the caller after use).

    Memory: allocates A (S·n) and dH (S·G) plus the activation's own temporaries.
    """
    with torch.enable_grad():
        h = h_SG.detach().requires_grad_(True)
        a_SN = apply_activation(h, activation)
        (grad_h_SG,) = torch.autograd.grad(a_SN, h, grad_a_SN)
    return a_SN.detach(), grad_h_SG
