"""Activations and their closed-form backward (recomputed from H) against autograd in float64;
the combine helpers (selection of sentinel slots, per-token sums)."""

from __future__ import annotations

import pytest
import torch

from memfine.ops.activations import activation_backward, apply_activation
from memfine.ops.combine import combine_rows, reduce_rows, scatter_slots, slot_rows
from tolerances import assert_close


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "relu", "silu"])
def test_backward_matches_autograd(activation: str) -> None:
    G = 12 if activation in ("swiglu", "geglu") else 6
    h_SG = torch.randn(7, G, dtype=torch.float64, requires_grad=True)
    a_SN = apply_activation(h_SG, activation)
    grad_a_SN = torch.randn_like(a_SN)
    (want,) = torch.autograd.grad(a_SN, h_SG, grad_a_SN)
    assert_close(activation_backward(h_SG.detach(), grad_a_SN, activation), want, grad=True)


def test_in_place_forward_outside_autograd_is_equal() -> None:
    h_SG = torch.randn(5, 8)
    with torch.no_grad():
        fast = apply_activation(h_SG, "swiglu")
    assert torch.equal(fast, apply_activation(h_SG.requires_grad_(), "swiglu").detach())


def test_gated_width_must_be_even() -> None:
    with pytest.raises(ValueError, match="even H width"):
        apply_activation(torch.randn(2, 5), "swiglu")
    with pytest.raises(ValueError, match="activation must be one of"):
        activation_backward(torch.randn(2, 4), torch.randn(2, 2), "tanh")


def test_a_gate_function_without_a_formula_is_refused() -> None:
    """A gate_fn added to GatedActivation but not to ops/activations.py must not run as SiLU."""
    import dataclasses

    from memfine.config import GatedActivation

    spec = object.__new__(GatedActivation)  # bypass the config's own check, as a half-done edit
    for field in dataclasses.fields(GatedActivation):
        object.__setattr__(spec, field.name, getattr(GatedActivation(), field.name))
    object.__setattr__(spec, "gate_fn", "relu")
    h_SG = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="gate_fn='relu' has no formula"):
        apply_activation(h_SG, spec)
    with pytest.raises(ValueError, match="gate_fn='relu' has no formula"):
        activation_backward(h_SG, torch.randn(3, 4, dtype=torch.float64), spec)


def test_combine_selects_out_sentinels() -> None:
    y_SD = torch.tensor([[1.0, 2.0], [float("nan"), 4.0], [5.0, 6.0]])
    map_TK = torch.tensor([[0, -1], [2, 1], [-1, -1]], dtype=torch.int32)
    weights_TK = torch.tensor([[0.5, float("nan")], [2.0, 0.0], [float("nan"), 1.0]])
    rows = slot_rows(y_SD, map_TK)
    assert torch.equal(rows[0, 1], torch.zeros(2)) and torch.equal(rows[2], torch.zeros(2, 2))
    out = combine_rows(y_SD, weights_TK, map_TK)
    assert torch.equal(out[0], torch.tensor([0.5, 1.0]))
    assert torch.equal(out[2], torch.zeros(2))  # all-sentinel token: exact zero, no NaN
    assert torch.isnan(out[1, 0]) and out[1, 1] == 12.0  # a valid NaN row stays NaN
    assert torch.equal(reduce_rows(y_SD[[0, 2]], torch.tensor([[0, 1], [-1, 1]])),
                       torch.tensor([[6.0, 8.0], [5.0, 6.0]]))
    assert torch.equal(scatter_slots(torch.tensor([7.0, 8.0]), torch.tensor([3, 0]), (2, 2)),
                       torch.tensor([[8.0, 0.0], [0.0, 7.0]]))
