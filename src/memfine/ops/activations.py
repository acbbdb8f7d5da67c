"""Expert activations on the pre-activation H and their closed-form backward, recomputed from H.

Legend: S routed rows, G = 2n (gated) or n columns of H, N = n.
Gated layout: H = [gate | up] (gate in columns [0, n), up in [n, 2n)); A = act(gate) ⊙ up.
The backward uses ATen's fused elementwise derivatives (``silu_backward``, ``gelu_backward``,
``threshold_backward``) instead of re-running autograd on the activation, so it reads H once and
allocates only dH (plus act(gate) for gated activations).
Reference: DESIGN.md §1 (SwiGLU experts), MoEBlaze §4 (activation recomputed from H).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from memfine.config import GATED_ACTIVATIONS

_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
}
# d act(v) / dv applied to an incoming gradient: f(grad, v) -> grad · act'(v).
_ELEMENTWISE_BACKWARD: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": torch.ops.aten.silu_backward,
    "gelu": lambda g, v: torch.ops.aten.gelu_backward(g, v, approximate="tanh"),
    "relu": lambda g, v: torch.ops.aten.threshold_backward(g, v, 0),
}
_GATE = {"swiglu": "silu", "geglu": "gelu"}


def check_activation(activation: str) -> None:
    """Raise ValueError for an unknown activation name."""
    if activation not in _GATE and activation not in _ELEMENTWISE:
        allowed = sorted([*_GATE, *_ELEMENTWISE])
        raise ValueError(f"activation must be one of {allowed}, got {activation!r}")


def _split_gated(h_SG: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    if h_SG.shape[-1] % 2:
        raise ValueError(f"gated activation {activation!r} needs an even H width, "
                         f"got {h_SG.shape[-1]}")
    gate_SN, up_SN = h_SG.chunk(2, dim=-1)
    return gate_SN, up_SN


def apply_activation(h_SG: torch.Tensor, activation: str) -> torch.Tensor:
    """A = act(H): (S, 2n) → (S, n) for gated activations, (S, n) → (S, n) otherwise.

    Args:
        h_SG: (S, G) pre-activation, any float dtype.
        activation: ``swiglu``, ``geglu``, ``silu``, ``gelu`` (tanh approximation) or ``relu``.

    Returns:
        (S, n) new tensor in H's dtype (differentiable when H requires grad).

    Raises:
        ValueError: for an unknown activation, or an odd width with a gated one.
    """
    check_activation(activation)
    if activation in GATED_ACTIVATIONS:
        gate_SN, up_SN = _split_gated(h_SG, activation)
        act_gate_SN = _ELEMENTWISE[_GATE[activation]](gate_SN)
        if torch.is_grad_enabled() and h_SG.requires_grad:
            return act_gate_SN * up_SN
        return act_gate_SN.mul_(up_SN)  # NOTE(memory): in place outside autograd, saves S·n
    return _ELEMENTWISE[activation](h_SG)


def activation_backward(h_SG: torch.Tensor, grad_a_SN: torch.Tensor, activation: str
                        ) -> torch.Tensor:
    """Compute dH from the saved H and dA (no autograd; A itself is not needed).

    Args:
        h_SG: (S, G) saved pre-activation.
        grad_a_SN: (S, n) gradient of the loss w.r.t. A, same dtype as H.
        activation: activation name.

    Returns:
        (S, G) new tensor dH. Gated: dgate = dA ⊙ up ⊙ act'(gate), dup = dA ⊙ act(gate).

    Raises:
        ValueError: for an unknown activation, or an odd width with a gated one.

    Memory: allocates dH (S·G) and, for gated activations, act(gate) and dA ⊙ up (S·n each),
    both transient.
    """
    check_activation(activation)
    if activation not in GATED_ACTIVATIONS:
        return _ELEMENTWISE_BACKWARD[activation](grad_a_SN, h_SG)
    gate_SN, up_SN = _split_gated(h_SG, activation)
    name = _GATE[activation]
    grad_h_SG = torch.empty_like(h_SG)
    grad_gate_SN, grad_up_SN = grad_h_SG.chunk(2, dim=-1)
    # copy_ into the view, not out=: torch.compile traces no out= into a non-contiguous view.
    grad_up_SN.copy_(_ELEMENTWISE[name](gate_SN).mul_(grad_a_SN))
    grad_gate_SN.copy_(_ELEMENTWISE_BACKWARD[name](grad_a_SN * up_SN, gate_SN))
    return grad_h_SG
