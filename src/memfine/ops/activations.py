"""Expert activations on the pre-activation H and their closed-form backward, recomputed from H.

Legend: S routed rows, G = 2n (gated) or n columns of H, N = n.
An activation is a name (``swiglu``, ``geglu``: gated; ``silu``, ``gelu``, ``relu``, ``relu2``
(ReLU²): elementwise)
or a :class:`GatedActivation`, the general gated form
A = f_α(min(gate, limit)) ⊙ (clamp(up, ±limit) + up_offset), with gate and up read from H either
as halves (``[gate | up]``, the default) or interleaved (``gate = H[:, 0::2]``, ``up = H[:, 1::2]``,
GPT-OSS). ``swiglu`` is ``GatedActivation()``; GPT-OSS is ``GatedActivation.gpt_oss()``.
The backward uses ATen's fused elementwise derivatives (``silu_backward``, ``gelu_backward``,
``threshold_backward``) instead of re-running autograd on the activation, so it reads H once and
allocates only dH (plus act(gate) for gated activations).
Reference: docs/design.md §1 (SwiGLU experts), MoEBlaze §4 (activation recomputed from H); the
clamped form is transformers' ``GptOssExperts._apply_gate`` (our reading of its code).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from memfine.config import GatedActivation

_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda h: torch.square(F.relu(h)),  # ReLU² (Primer; Nemotron-H's experts)
}
# d act(v) / dv applied to an incoming gradient: f(grad, v) -> grad · act'(v).
_ELEMENTWISE_BACKWARD: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": torch.ops.aten.silu_backward,
    "gelu": lambda g, v: torch.ops.aten.gelu_backward(g, v, approximate="tanh"),
    "relu": lambda g, v: torch.ops.aten.threshold_backward(g, v, 0),
    "relu2": lambda g, v: torch.ops.aten.threshold_backward(g * v * 2, v, 0),
}


Activation = str | GatedActivation
_NAMED_GATED = {"swiglu": GatedActivation(), "geglu": GatedActivation(gate_fn="gelu")}


def check_activation(activation: Activation) -> None:
    """Raise ValueError for an unknown activation name or a non-activation object."""
    if isinstance(activation, GatedActivation):
        return
    if activation not in _NAMED_GATED and activation not in _ELEMENTWISE:
        allowed = sorted([*_NAMED_GATED, *_ELEMENTWISE])
        raise ValueError(f"activation must be one of {allowed} or a GatedActivation, "
                         f"got {activation!r}")


def is_gated(activation: Activation) -> bool:
    """True when H holds gate and up columns (G = 2n).

    Raises:
        ValueError: for an unknown activation.
    """
    check_activation(activation)
    return isinstance(activation, GatedActivation) or activation in _NAMED_GATED


def _spec(activation: Activation) -> GatedActivation | None:
    if isinstance(activation, GatedActivation):
        return activation
    return _NAMED_GATED.get(activation)


def _split_gated(h_SG: torch.Tensor, spec: GatedActivation) -> tuple[torch.Tensor, torch.Tensor]:
    if h_SG.shape[-1] % 2:
        raise ValueError(f"gated activation {spec!r} needs an even H width, "
                         f"got {h_SG.shape[-1]}")
    if spec.interleaved:
        return h_SG[:, 0::2], h_SG[:, 1::2]
    gate_SN, up_SN = h_SG.chunk(2, dim=-1)
    return gate_SN, up_SN


def _gate_value(gate_SN: torch.Tensor, spec: GatedActivation) -> torch.Tensor:
    """f_α(gate) as a new tensor (gate already clamped).

    Raises:
        ValueError: on a ``gate_fn`` this module has no formula for (a name added to
            ``GatedActivation`` but not here).
    """
    if spec.gate_fn == "gelu":
        return F.gelu(gate_SN, approximate="tanh")
    _check_gate_fn(spec)
    if spec.alpha == 1.0:
        return F.silu(gate_SN)
    return gate_SN * torch.sigmoid(gate_SN * spec.alpha)  # GPT-OSS's order of operations


def _check_gate_fn(spec: GatedActivation) -> None:
    if spec.gate_fn != "silu":
        raise ValueError(f"GatedActivation.gate_fn={spec.gate_fn!r} has no formula in "
                         f"memfine.ops.activations (known: 'silu', 'gelu')")


def _clamped(gate_SN: torch.Tensor, up_SN: torch.Tensor, spec: GatedActivation
             ) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.limit is None:
        return gate_SN, up_SN
    return gate_SN.clamp(max=spec.limit), up_SN.clamp(min=-spec.limit, max=spec.limit)


def _apply_gated(h_SG: torch.Tensor, spec: GatedActivation) -> torch.Tensor:
    h_in = h_SG.float() if spec.upcast else h_SG
    gate_SN, up_SN = _clamped(*_split_gated(h_in, spec), spec)
    act_gate_SN = _gate_value(gate_SN, spec)
    if spec.up_offset != 0.0:
        up_SN = up_SN + spec.up_offset
    if torch.is_grad_enabled() and h_SG.requires_grad:
        a_SN = act_gate_SN * up_SN
    else:
        a_SN = act_gate_SN.mul_(up_SN)  # NOTE(memory): in place outside autograd, saves S·n
    return a_SN.to(h_SG.dtype)


def apply_activation(h_SG: torch.Tensor, activation: Activation) -> torch.Tensor:
    """A = act(H): (S, 2n) → (S, n) for gated activations, (S, n) → (S, n) otherwise.

    Args:
        h_SG: (S, G) pre-activation, any float dtype.
        activation: ``swiglu``, ``geglu``, ``silu``, ``gelu`` (tanh approximation), ``relu``,
            ``relu2`` (ReLU²) or a :class:`GatedActivation`.

    Returns:
        (S, n) new tensor in H's dtype (differentiable when H requires grad).

    Raises:
        ValueError: for an unknown activation, or an odd width with a gated one.
    """
    check_activation(activation)
    spec = _spec(activation)
    if spec is not None:
        return _apply_gated(h_SG, spec)
    assert isinstance(activation, str), "a non-gated activation is a name"
    return _ELEMENTWISE[activation](h_SG)


def activation_and_gate(h_SG: torch.Tensor, activation: Activation
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A = act(H) and, for a gated activation, f_α(gate′) for :func:`activation_backward`.

    The fused backward recomputes A and then needs f_α(gate′) again for dup = dA ⊙ f_α(gate′);
    keeping it saves one pass of the gate function over the rows.

    Args:
        h_SG: (S, G) pre-activation (no autograd: called inside a custom backward).
        activation: as :func:`apply_activation`.

    Returns:
        ``(A, gate_value)``: A (S, n) in H's dtype; gate_value (S, n) in the activation's compute
        dtype (fp32 when the spec upcasts), or None for a non-gated activation.

    Memory: two new (S, n) tensors for a gated activation (one otherwise), plus the clamped copies
    and the offset ``up`` when the spec has them.
    """
    spec = _spec(activation)
    if spec is None:
        return apply_activation(h_SG, activation), None
    h_in = h_SG.float() if spec.upcast else h_SG
    gate_SN, up_SN = _clamped(*_split_gated(h_in, spec), spec)
    gate_value_SN = _gate_value(gate_SN, spec)
    if spec.up_offset != 0.0:
        up_SN = up_SN + spec.up_offset
    return (gate_value_SN * up_SN).to(h_SG.dtype), gate_value_SN


def _gate_backward(grad_SN: torch.Tensor, gate_SN: torch.Tensor, spec: GatedActivation,
                   out_SN: torch.Tensor) -> None:
    """Write grad · f_α'(gate) (gate already clamped) into ``out_SN``."""
    if spec.gate_fn == "gelu":
        torch.ops.aten.gelu_backward.grad_input(grad_SN, gate_SN, approximate="tanh",
                                                grad_input=out_SN)
        return
    _check_gate_fn(spec)
    # f_α(g) = silu(α·g) / α, so f_α'(g) = silu'(α·g).
    arg_SN = gate_SN if spec.alpha == 1.0 else gate_SN * spec.alpha
    torch.ops.aten.silu_backward.grad_input(grad_SN, arg_SN, grad_input=out_SN)


def _gated_backward(h_SG: torch.Tensor, grad_a_SN: torch.Tensor, spec: GatedActivation,
                    gate_value_SN: torch.Tensor | None = None) -> torch.Tensor:
    h_in = h_SG.float() if spec.upcast else h_SG
    grad_a = grad_a_SN.to(h_in.dtype)
    raw_gate_SN, raw_up_SN = _split_gated(h_in, spec)
    gate_SN, up_SN = _clamped(raw_gate_SN, raw_up_SN, spec)
    grad_h_SG = torch.empty_like(h_in)
    grad_gate_SN, grad_up_SN = _split_gated(grad_h_SG, spec)
    if gate_value_SN is None:
        gate_value_SN = _gate_value(gate_SN, spec)
    if spec.up_offset != 0.0:
        up_SN = up_SN + spec.up_offset
    if torch.compiler.is_compiling():
        # copy_ into the views: torch.compile traces no out= into a non-contiguous view.
        grad_up_SN.copy_(gate_value_SN * grad_a)
        grad_gate_SN.copy_(_gate_grad(grad_a * up_SN, gate_SN, spec))
    else:  # NOTE(memory): written into dH's halves in place: no (S, n) temporary
        torch.mul(gate_value_SN, grad_a, out=grad_up_SN)
        torch.mul(grad_a, up_SN, out=grad_gate_SN)  # dA ⊙ up, then ⊙ f' in place
        _gate_backward(grad_gate_SN, gate_SN, spec, grad_gate_SN)
    if spec.limit is not None:  # clamp passes the gradient where min <= v <= max (as torch)
        grad_gate_SN.masked_fill_(raw_gate_SN > spec.limit, 0)
        grad_up_SN.masked_fill_(raw_up_SN.abs() > spec.limit, 0)
    return grad_h_SG.to(h_SG.dtype)


def _gate_grad(grad_SN: torch.Tensor, gate_SN: torch.Tensor, spec: GatedActivation
               ) -> torch.Tensor:
    """Return grad · f_α'(gate) as a new tensor (the traceable form of `_gate_backward`)."""
    out_SN = torch.empty_like(gate_SN)
    _gate_backward(grad_SN, gate_SN, spec, out_SN)
    return out_SN


def activation_backward(h_SG: torch.Tensor, grad_a_SN: torch.Tensor, activation: Activation,
                        gate_value_SN: torch.Tensor | None = None) -> torch.Tensor:
    """Compute dH from the saved H and dA (no autograd; A itself is not needed).

    Args:
        h_SG: (S, G) saved pre-activation.
        grad_a_SN: (S, n) gradient of the loss w.r.t. A, same dtype as H.
        activation: activation name or :class:`GatedActivation`.
        gate_value_SN: optional f_α(gate′) of a gated activation, as
            :func:`activation_and_gate` returns it (not recomputed then); ignored otherwise.

    Returns:
        (S, G) new tensor dH in H's dtype. Gated: dgate = dA ⊙ (up' + offset) ⊙ f_α'(gate'),
        dup = dA ⊙ f_α(gate') with gate', up' the clamped halves; zero where a clamp is active
        (v > limit, or |up| > limit), as torch's clamp backward.

    Raises:
        ValueError: for an unknown activation, or an odd width with a gated one.

    Memory: allocates dH (S·G) and, for gated activations unless given, f_α(gate) (S·n;
    clamped copies of gate and up, S·n each, with a limit; under torch.compile also dA ⊙ up),
    all transient; in eager mode dA ⊙ f_α(gate) and dA ⊙ up ⊙ f_α'(gate) are written into dH's
    halves in place.
    """
    check_activation(activation)
    spec = _spec(activation)
    if spec is not None:
        return _gated_backward(h_SG, grad_a_SN, spec, gate_value_SN)
    assert isinstance(activation, str), "a non-gated activation is a name"
    return _ELEMENTWISE_BACKWARD[activation](grad_a_SN, h_SG)
