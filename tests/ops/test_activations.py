"""Activations and their closed-form backward (recomputed from H) against autograd in float64;
the combine helpers (selection of sentinel slots, per-token sums)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch

import timeouts
from memfine.activations import (
    ACTIVATIONS,
    GATE_FUNCTIONS,
    activation_backward,
    apply_activation,
    is_gated,
)
from memfine.config import GatedActivation, MoEConfig
from memfine.ops.combine import combine_rows, reduce_rows, scatter_slots, slot_rows
from memfine.reference import REFERENCE_ACTIVATIONS, REFERENCE_GATES, reference_experts
from tolerances import assert_close


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_backward_matches_autograd(activation: str) -> None:
    G = 12 if is_gated(activation) else 6
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
    """A gate_fn added to GatedActivation but not to activations/functions.py is not run as SiLU."""
    spec = object.__new__(GatedActivation)  # bypass the config's own check, as a half-done edit
    for field in dataclasses.fields(GatedActivation):
        object.__setattr__(spec, field.name, getattr(GatedActivation(), field.name))
    object.__setattr__(spec, "gate_fn", "relu")
    h_SG = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="gate_fn='relu' has no formula"):
        apply_activation(h_SG, spec)
    with pytest.raises(ValueError, match="gate_fn='relu' has no formula"):
        activation_backward(h_SG, torch.randn(3, 4, dtype=torch.float64), spec)


def _half_done_spec(gate_fn: str) -> GatedActivation:
    spec = object.__new__(GatedActivation)  # bypass the config's own check, as a half-done edit
    for field in dataclasses.fields(GatedActivation):
        object.__setattr__(spec, field.name, getattr(GatedActivation(), field.name))
    object.__setattr__(spec, "gate_fn", gate_fn)
    return spec


def _experts_inputs(G: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g)
    idx = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    w = torch.rand(5, 2, dtype=torch.float64, generator=g)
    N = 6
    return (x, idx, w, torch.randn(2, 4, G, dtype=torch.float64, generator=g),
            torch.randn(2, N, 4, dtype=torch.float64, generator=g))


def test_the_reference_refuses_a_gate_it_has_no_formula_for() -> None:
    """A new gate_fn the reference lacks must not run there as GELU (blaming the fused path)."""
    with pytest.raises(ValueError, match="reference has no formula for GatedActivation.gate_fn="
                                         "'relu'"):
        reference_experts(*_experts_inputs(12), activation=_half_done_spec("relu"))
    with pytest.raises(ValueError, match="reference has no formula for activation='tanh'"):
        reference_experts(*_experts_inputs(6), activation="tanh")


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_every_entry_equals_its_reference_formula(activation: str) -> None:
    h_SG = torch.randn(7, 12 if is_gated(activation) else 6, dtype=torch.float64)
    assert_close(apply_activation(h_SG, activation), REFERENCE_ACTIVATIONS[activation](h_SG))


@pytest.mark.parametrize("gate_fn", list(GATE_FUNCTIONS))
def test_every_gate_function_equals_its_reference_formula(gate_fn: str) -> None:
    h_SG = torch.randn(7, 12, dtype=torch.float64)
    for alpha in ((1.0, 1.702) if gate_fn == "silu" else (1.0,)):
        spec = GatedActivation(gate_fn=gate_fn, alpha=alpha)  # type: ignore[arg-type]
        assert_close(apply_activation(h_SG, spec), REFERENCE_GATES[gate_fn](h_SG[:, :6], alpha)
                     * h_SG[:, 6:])


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_the_config_and_the_experts_accept_the_same_names(activation: str) -> None:
    """MoEConfig(activation=...) and run_experts(activation=...) read the one table."""
    moe = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=2, top_k=1,
                    renormalize=False, activation=activation)  # type: ignore[arg-type]
    assert moe.gated == is_gated(activation)


HALF_ADDED = [
    ('ACTIVATIONS["tanh"] = ACTIVATIONS["gelu"]',
     "memfine.config.Activation .* and ACTIVATIONS .* must list the same names"),
    ('GATE_FUNCTIONS["relu"] = GATE_FUNCTIONS["silu"]',
     "memfine.config.GateFn .* and GATE_FUNCTIONS .* must list the same names"),
]
# One child process for every edit: each runs on a fresh copy of the module's source, and the
# child prints, per edit, the last line of the error its import raised (None if none).
_CHILD = """
import importlib.util, json, sys, traceback
spec = importlib.util.find_spec("memfine.activations.functions")
head, tail = open(spec.origin).read().rsplit("_check_tables()", 1)  # the module-level call, last
results = {}
for edit in json.loads(sys.argv[1]):
    module = importlib.util.module_from_spec(spec)
    try:
        exec(compile(head + edit + "; _check_tables()" + tail, spec.origin, "exec"),
             module.__dict__)
        results[edit] = None
    except Exception as error:
        results[edit] = traceback.format_exception_only(error)[-1].strip().splitlines()[-1]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def half_added_errors() -> dict[str, str | None]:
    done = timeouts.run([sys.executable, "-c", _CHILD, json.dumps([e for e, _ in HALF_ADDED])],
                        300, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    errors: dict[str, str | None] = json.loads(done.stdout.strip().splitlines()[-1])
    return errors


@pytest.mark.parametrize(("edit", "message"), HALF_ADDED)
def test_a_half_added_table_entry_fails_at_import(half_added_errors: dict[str, str | None],
                                                  edit: str, message: str) -> None:
    last = half_added_errors[edit]
    assert last is not None and last.startswith("ImportError: ") and re.search(message, last), last


def test_a_config_name_without_a_reference_formula_fails_at_import() -> None:
    script = """
import typing
import memfine.config
memfine.config.Activation = typing.Literal[(*typing.get_args(memfine.config.Activation), "tanh")]
import memfine.reference
"""
    done = timeouts.run([sys.executable, "-c", script], 300, capture_output=True, check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: memfine.reference.REFERENCE_ACTIVATIONS"), done.stderr


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
