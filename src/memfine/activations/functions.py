"""Expert activations on the pre-activation H and their closed-form backward, recomputed from H.

Legend: S routed rows, G = 2n (gated) or n columns of H, N = n.
An activation is a name of the one table :data:`ACTIVATIONS` (``swiglu``, ``geglu``: gated;
``silu``, ``gelu``, ``relu``, ``relu2`` (ReLU²): elementwise), which the config check, the slow
reference and the transformers gate matching read (checked when this module is imported),
or a :class:`GatedActivation`, the general gated form
A = f_α(min(gate, limit)) ⊙ (clamp(up, ±limit) + up_offset), with gate and up read from H either
as halves (``[gate | up]``, the default) or interleaved (``gate = H[:, 0::2]``, ``up = H[:, 1::2]``,
GPT-OSS), its gate function f_α one of :data:`GATE_FUNCTIONS`. ``swiglu`` is
``GatedActivation()``; GPT-OSS is ``GatedActivation.gpt_oss()``.
The backward uses ATen's fused elementwise derivatives (``silu_backward``, ``gelu_backward``,
``threshold_backward``) instead of re-running autograd on the activation, so it reads H once and
allocates only dH (plus act(gate) for gated activations).
Reference: docs/design.md §1 (SwiGLU experts), MoEBlaze §4 (activation recomputed from H); the
clamped form is transformers' ``GptOssExperts._apply_gate`` (our reading of its code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F

from memfine.config import (
    ACTIVATIONS_SAVING_OUTPUT,
    GATED_ACTIVATIONS,
    GatedActivation,
    GateFn,
)
from memfine.config import Activation as ActivationName


class _ReLU2(torch.autograd.Function):
    """ReLU² under autograd with silu's memory: saves H only, dH written in one allocation."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return _relu2(h)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return _relu2_backward(grad, h)


def _relu2(h: torch.Tensor) -> torch.Tensor:
    """max(h, 0)²: one new tensor (squared in place)."""
    return F.relu(h).square_()


def _relu2_backward(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The gradient grad · 2·max(h, 0): one new tensor (scaled and masked in place)."""
    out = torch.mul(grad, h).mul_(2)
    return torch.ops.aten.threshold_backward.grad_input(out, h, 0, grad_input=out)


@dataclass(frozen=True, slots=True)
class ElementwiseForm:
    """The formulas of an elementwise (non-gated) activation.

    Attributes:
        forward: (S, n) H → (S, n) A, a new tensor, differentiable under autograd.
        backward: ``(dA, H) -> dH``, a new tensor (A not needed).
        keeps_output: autograd keeps A (the function's result) instead of H for its backward
            (ReLU): the plain path's memory (``memfine.config.ACTIVATIONS_SAVING_OUTPUT``).
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    keeps_output: bool = False


@dataclass(frozen=True, slots=True)
class ActivationEntry:
    """One named activation of :data:`ACTIVATIONS`.

    Attributes:
        name: the ``activation`` value (``MoEConfig.activation``, ``run_experts``).
        formula: A as docs/design.md writes it.
        form: a :class:`GatedActivation` (H holds gate and up, G = 2n) or an
            :class:`ElementwiseForm` (G = n).
        hf_act_fn: for a gated entry, the transformers ``act_fn`` (by memfine's elementwise
            name) whose default ``act_fn(gate) * up`` this entry computes; None otherwise.
        source: where the activation comes from.
    """

    name: str
    formula: str
    form: GatedActivation | ElementwiseForm
    source: str
    hf_act_fn: str | None = None


@dataclass(frozen=True, slots=True)
class GateFunction:
    """f_α of a :class:`GatedActivation`'s gate half (``gate_fn``): value and derivative.

    Attributes:
        name: the ``GatedActivation.gate_fn`` value.
        formula: f_α(g) as written in the docs.
        value: ``(gate, α) -> f_α(gate)``, a new tensor.
        backward_into: ``(grad, gate, α, out)``: writes grad · f_α'(gate) into ``out``.
    """

    name: str
    formula: str
    value: Callable[[torch.Tensor, float], torch.Tensor]
    backward_into: Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor], None]


def _silu_value(gate: torch.Tensor, alpha: float) -> torch.Tensor:
    if alpha == 1.0:
        return F.silu(gate)
    return gate * torch.sigmoid(gate * alpha)  # GPT-OSS's order of operations


def _silu_backward_into(grad: torch.Tensor, gate: torch.Tensor, alpha: float,
                        out: torch.Tensor) -> None:
    # f_α(g) = silu(α·g) / α, so f_α'(g) = silu'(α·g).
    arg = gate if alpha == 1.0 else gate * alpha
    torch.ops.aten.silu_backward.grad_input(grad, arg, grad_input=out)


def _gelu_backward_into(grad: torch.Tensor, gate: torch.Tensor, alpha: float,
                        out: torch.Tensor) -> None:
    torch.ops.aten.gelu_backward.grad_input(grad, gate, approximate="tanh", grad_input=out)


GATE_FUNCTIONS: dict[str, GateFunction] = {f.name: f for f in (
    GateFunction("silu", "f_α(g) = g·σ(α·g)", _silu_value, _silu_backward_into),
    GateFunction("gelu", "f(g) = GELU_tanh(g) (α = 1)",
                 lambda g, alpha: F.gelu(g, approximate="tanh"), _gelu_backward_into),
)}
"""Every gate function by name; the keys are exactly :data:`memfine.config.GateFn`."""

ACTIVATIONS: dict[str, ActivationEntry] = {a.name: a for a in (
    ActivationEntry("swiglu", "SiLU(gate) ⊙ up", GatedActivation(), "Shazeer 2020 (GLU "
                    "variants); Mixtral, Qwen-MoE, DeepSeek", hf_act_fn="silu"),
    ActivationEntry("geglu", "GELU_tanh(gate) ⊙ up", GatedActivation(gate_fn="gelu"),
                    "Shazeer 2020 (GLU variants)", hf_act_fn="gelu"),
    ActivationEntry("silu", "h·σ(h)", ElementwiseForm(F.silu, torch.ops.aten.silu_backward),
                    "Hendrycks & Gimpel 2016"),
    ActivationEntry("gelu", "GELU, tanh approximation", ElementwiseForm(
        lambda h: F.gelu(h, approximate="tanh"),
        lambda g, v: torch.ops.aten.gelu_backward(g, v, approximate="tanh")),
                    "Hendrycks & Gimpel 2016"),
    ActivationEntry("relu", "max(h, 0)", ElementwiseForm(
        F.relu, lambda g, v: torch.ops.aten.threshold_backward(g, v, 0), keeps_output=True),
                    "Nair & Hinton 2010"),
    ActivationEntry("relu2", "max(h, 0)²", ElementwiseForm(_ReLU2.apply, _relu2_backward),
                    "Primer (So et al. 2021); Nemotron-H's experts"),
)}
"""Every named activation; the keys are exactly :data:`memfine.config.Activation`.

Adding one (docs/extending.md): an entry here, its name in ``memfine.config.Activation`` (plus
``GATED_ACTIVATIONS`` / ``ACTIVATIONS_SAVING_OUTPUT`` where it applies), its formula in
``memfine.reference.REFERENCE_ACTIVATIONS``. A half-done entry fails when this module (or the
reference) is imported, naming the list it is missing from."""


def _check_tables() -> None:
    """ImportError naming the list that disagrees with the tables (a memfine bug)."""
    checks = (
        ("memfine.config.Activation", set(get_args(ActivationName)), set(ACTIVATIONS),
         "ACTIVATIONS"),
        ("memfine.config.GATED_ACTIVATIONS", set(GATED_ACTIVATIONS),
         {n for n, a in ACTIVATIONS.items() if isinstance(a.form, GatedActivation)},
         "the gated entries of ACTIVATIONS"),
        ("memfine.config.ACTIVATIONS_SAVING_OUTPUT", set(ACTIVATIONS_SAVING_OUTPUT),
         {n for n, a in ACTIVATIONS.items()
          if isinstance(a.form, ElementwiseForm) and a.form.keeps_output},
         "the keeps_output entries of ACTIVATIONS"),
        ("memfine.config.GateFn", set(get_args(GateFn)), set(GATE_FUNCTIONS), "GATE_FUNCTIONS"),
    )
    for where, listed, table, name in checks:
        if listed != table:
            raise ImportError(f"{where} {sorted(listed)} and {name} {sorted(table)} in "
                              f"{__name__} must list the same names")


_check_tables()

Activation = str | GatedActivation


def check_activation(activation: Activation) -> None:
    """Raise ValueError for an unknown activation name or a non-activation object."""
    if isinstance(activation, GatedActivation):
        return
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a "
                         f"GatedActivation, got {activation!r}")


def is_gated(activation: Activation) -> bool:
    """True when H holds gate and up columns (G = 2n).

    Raises:
        ValueError: for an unknown activation.
    """
    check_activation(activation)
    return _spec(activation) is not None


def gated_name(act_fn: str) -> str | None:
    """The named gated activation whose gate is ``act_fn`` (``silu`` → ``swiglu``), or None."""
    return next((a.name for a in ACTIVATIONS.values() if a.hf_act_fn == act_fn), None)


def _spec(activation: Activation) -> GatedActivation | None:
    if isinstance(activation, GatedActivation):
        return activation
    form = ACTIVATIONS[activation].form
    return form if isinstance(form, GatedActivation) else None


def _elementwise(activation: Activation) -> ElementwiseForm:
    assert isinstance(activation, str), "a non-gated activation is a name"
    form = ACTIVATIONS[activation].form
    assert isinstance(form, ElementwiseForm), "a non-gated activation is elementwise"
    return form


def _gate_function(spec: GatedActivation) -> GateFunction:
    """The spec's gate function; ValueError on a ``gate_fn`` without one (a half-done form)."""
    if spec.gate_fn not in GATE_FUNCTIONS:
        raise ValueError(f"GatedActivation.gate_fn={spec.gate_fn!r} has no formula in "
                         f"{__name__}.GATE_FUNCTIONS (known: {sorted(GATE_FUNCTIONS)})")
    return GATE_FUNCTIONS[spec.gate_fn]


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
        ValueError: on a ``gate_fn`` :data:`GATE_FUNCTIONS` has no entry for.
    """
    return _gate_function(spec).value(gate_SN, spec.alpha)


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
    return _elementwise(activation).forward(h_SG)


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
    _gate_function(spec).backward_into(grad_SN, gate_SN, spec.alpha, out_SN)


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
    return _elementwise(activation).backward(grad_a_SN, h_SG)
