"""An up-projection held as (gate, up) halves equals the concatenated tensor: values, every
gradient (each half gets its slice of the concatenated weight's gradient), float64 gradcheck,
the saved set (no weight copy), and the errors.

Reference: memfine.ops.up_projection; torchtitan's GroupedExperts keeps w1 and w3 apart.
"""

from __future__ import annotations

import pytest
import torch

from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.measure.saved import track_saved_tensors
from memfine.reference import reference_experts
from tolerances import assert_close


def _problem(dtype: torch.dtype, T: int = 11, d: int = 8, n: int = 4, E: int = 5, k: int = 2):
    idx_TK = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])  # expert E-1 unused
    x = torch.randn(T, d, dtype=dtype, requires_grad=True)
    w = torch.rand(T, k, dtype=dtype, requires_grad=True)
    # stored as torchtitan stores w1 / w3: (E, n, d), used through (E, d, n) transposed views
    gate_END = (torch.randn(E, n, d, dtype=dtype) / d ** 0.5).requires_grad_()
    up_END = (torch.randn(E, n, d, dtype=dtype) / d ** 0.5).requires_grad_()
    down = (torch.randn(E, n, d, dtype=dtype) / n ** 0.5).requires_grad_()
    return x, idx_TK, w, gate_END, up_END, down


@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_halves_equal_the_reference(impl: str, backend: str) -> None:
    x, idx, w, gate, up, down = _problem(torch.float32)
    E = gate.shape[0]
    index = build_routing_index(idx, E)
    out = run_experts(x, w, index, (gate.transpose(1, 2), up.transpose(1, 2)), down,
                      impl=impl, backend=backend)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w, gate, up, down), g)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, gate, up, down)]
    x64, w64, gate64, up64, down64 = leaves64
    w_up64 = torch.cat([gate64.transpose(1, 2), up64.transpose(1, 2)], dim=2)
    ref = reference_experts(x64, idx, w64, w_up64, down64, "swiglu")
    ref_grads = torch.autograd.grad(ref, leaves64, g.double())
    assert_close(out, ref.float(), dtype=torch.float32)
    for name, got, want in zip(("x", "w", "gate", "up", "down"), grads, ref_grads, strict=True):
        assert_close(got, want.float(), grad=True, dtype=torch.float32, msg=name)
    assert torch.equal(grads[2][E - 1], torch.zeros_like(grads[2][E - 1]))  # unused expert


@pytest.mark.parametrize("impl", ["fused", "plain"])
def test_halves_follow_autocast(impl: str) -> None:
    """Inside bf16 autocast both halves are cast like a single w_up: bf16 output equal to the
    concatenated tensor's under autocast, fp32 gradients for the fp32 halves."""
    x, idx, w, gate, up, down = _problem(torch.float32)
    index = build_routing_index(idx, gate.shape[0])
    w_up = torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=2).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_experts(x, w, index, (gate.transpose(1, 2), up.transpose(1, 2)), down,
                          impl=impl, backend="loop")
        want = run_experts(x, w, index, w_up, down, impl=impl, backend="loop")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want)
    grad_gate, grad_up = torch.autograd.grad(out.float().sum(), (gate, up))
    assert grad_gate.dtype == grad_up.dtype == torch.float32


def test_gradcheck_float64_halves() -> None:
    x, idx, w, gate, up, down = _problem(torch.float64, T=5, d=4, n=3, E=3)
    index = build_routing_index(idx, gate.shape[0])

    def fn(x_, w_, gate_, up_, down_):
        return run_experts(x_, w_, index, (gate_.transpose(1, 2), up_.transpose(1, 2)), down_,
                           backend="loop")

    assert torch.autograd.gradcheck(fn, (x, w, gate, up, down))


def test_halves_save_no_weight_copy() -> None:
    x, idx, w, gate, up, down = _problem(torch.float32, T=16, d=16, n=8)
    index = build_routing_index(idx, gate.shape[0])
    with track_saved_tensors(exclude=[gate, up, down]) as saved:
        run_experts(x, w, index, (gate.transpose(1, 2), up.transpose(1, 2)), down)
    T, D = x.shape
    S, G = index.num_rows, 2 * gate.shape[1]
    index_bytes = 4 * (2 * S + index.token_index_map.numel() + index.num_experts + 1)
    assert saved.total_bytes == 4 * (T * D + S * G + w.numel()) + index_bytes


def test_rejects_bad_halves() -> None:
    x, idx, w, gate, up, down = _problem(torch.float32)
    index = build_routing_index(idx, gate.shape[0])
    with pytest.raises(ValueError, match="halves must share shape"):
        run_experts(x, w, index, (gate.transpose(1, 2), up[:, :2].transpose(1, 2)), down)
    with pytest.raises(ValueError, match="needs a gated activation, got 'silu'"):
        run_experts(x, w, index, (gate.transpose(1, 2), up.transpose(1, 2)), down,
                    activation="silu")
