"""Expert biases and gated activations (GPT-OSS's clamped SwiGLU) on the fused and plain paths.

Checked against the per-token reference (memfine.reference, which writes the activation out by
element) in float64 (gradcheck) and fp32, and a hand-computed value; the fused Function's saved
set stays x, H, routing weights and int32 indices (a bias adds no saved activation); bias
gradients of unused experts are exact zeros.
Reference: MoEBlaze §4-§5; transformers' GptOssExperts._apply_gate (the clamped form).
"""

from __future__ import annotations

import math

import pytest
import torch

from devices import triton_cpu
from memfine.activations import activation_backward, apply_activation
from memfine.config import GatedActivation
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.measure.saved import track_saved_tensors
from memfine.reference import reference_experts
from tolerances import assert_close

# limit 0.5: with unit-scale H about half the entries are clamped, so both clamp branches run.
SPECS = [
    pytest.param(GatedActivation.gpt_oss(), id="gpt_oss"),
    pytest.param(GatedActivation.gpt_oss(alpha=1.702, limit=0.5), id="gpt_oss_limit0.5"),
    pytest.param(GatedActivation(limit=0.5), id="clamped_swiglu"),
    pytest.param(GatedActivation(gate_fn="gelu", limit=0.5, up_offset=-0.25), id="clamped_geglu"),
    pytest.param(GatedActivation(alpha=0.7, interleaved=True), id="interleaved_alpha"),
    pytest.param("swiglu", id="swiglu"),
    pytest.param("relu", id="relu"),
    pytest.param("relu2", id="relu2"),
]


def _problem(T: int, d: int, n: int, E: int, k: int, dtype: torch.dtype, activation: object,
             *, sentinels: int = 2) -> dict[str, torch.Tensor]:
    """Leaves x, weights, w_up, w_down, b_up, b_down and top_k_index; expert E-1 gets no rows."""
    G = n if activation in ("relu", "relu2") else 2 * n
    idx_TK = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])
    idx_TK.view(-1)[idx_TK.numel() - sentinels:] = E
    leaves = {
        "x": torch.randn(T, d, dtype=torch.float64),
        "weights": torch.rand(T, k, dtype=torch.float64),
        "w_up": torch.randn(E, d, G, dtype=torch.float64) / d ** 0.5,
        "w_down": torch.randn(E, n, d, dtype=torch.float64) / n ** 0.5,
        "b_up": torch.randn(E, G, dtype=torch.float64),
        "b_down": torch.randn(E, d, dtype=torch.float64),
    }
    out = {name: t.to(dtype).requires_grad_() for name, t in leaves.items()}
    out["idx"] = idx_TK
    return out


def _run(p: dict[str, torch.Tensor], activation: object, **kwargs: object) -> torch.Tensor:
    index = build_routing_index(p["idx"], p["w_up"].shape[0])
    return run_experts(p["x"], p["weights"], index, p["w_up"], p["w_down"], b_up_EG=p["b_up"],
                       b_down_ED=p["b_down"], activation=activation, **kwargs)  # type: ignore[arg-type]


def _reference(p: dict[str, torch.Tensor], activation: object) -> torch.Tensor:
    d = {name: t.detach().double().requires_grad_() for name, t in p.items() if name != "idx"}
    return reference_experts(d["x"], p["idx"], d["weights"], d["w_up"], d["w_down"],
                             activation, b_up_EG=d["b_up"], b_down_ED=d["b_down"]), d  # type: ignore[arg-type, return-value]


NAMES = ("x", "weights", "w_up", "w_down", "b_up", "b_down")


@pytest.mark.parametrize("activation", SPECS)
def test_activation_backward_matches_autograd(activation: object) -> None:
    G = 6 if activation in ("relu", "relu2") else 12
    h_SG = torch.randn(9, G, dtype=torch.float64, requires_grad=True)
    a_SN = apply_activation(h_SG, activation)  # type: ignore[arg-type]
    grad_a_SN = torch.randn_like(a_SN)
    (want,) = torch.autograd.grad(a_SN, h_SG, grad_a_SN)
    got = activation_backward(h_SG.detach(), grad_a_SN, activation)  # type: ignore[arg-type]
    assert_close(got, want, grad=True)


def test_gpt_oss_activation_hand_computed() -> None:
    """Interleaved H = [g0, u0, g1, u1]; gate clamped from above at 7, up to [-7, 7], + 1."""
    h = torch.tensor([[8.0, -9.0, -2.0, 0.5]], dtype=torch.float64)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    want = [7 * sig(1.702 * 7) * (-7 + 1), -2 * sig(1.702 * -2) * (0.5 + 1)]
    got = apply_activation(h, GatedActivation.gpt_oss())
    assert_close(got, torch.tensor([want], dtype=torch.float64))
    # d/dgate is 0 where the gate is clamped (8 > 7), d/dup is 0 where up is clamped (|-9| > 7).
    grad_h = activation_backward(h, torch.ones(1, 2, dtype=torch.float64),
                                 GatedActivation.gpt_oss())
    assert grad_h[0, 0] == 0 and grad_h[0, 1] == 0 and grad_h[0, 2] != 0 and grad_h[0, 3] != 0


@pytest.mark.parametrize("activation", SPECS)
def test_gradcheck_float64_with_biases(activation: object) -> None:
    p = _problem(T=5, d=3, n=2, E=4, k=2, dtype=torch.float64, activation=activation)
    index = build_routing_index(p["idx"], 4)

    def fn(*leaves: torch.Tensor) -> torch.Tensor:
        x, w, up, down, b_up, b_down = leaves
        return run_experts(x, w, index, up, down, b_up_EG=b_up, b_down_ED=b_down,
                           activation=activation, backend="loop")  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(fn, tuple(p[name] for name in NAMES))


@pytest.mark.parametrize("activation", SPECS)
@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize(("backend", "d", "n"), [
    pytest.param("loop", 6, 5, id="loop-odd_d_n"),
    pytest.param("grouped_mm", 8, 12, id="grouped_mm"),
    pytest.param("auto", 6, 12, id="auto-unaligned"),
])
def test_fp32_matches_reference(activation: object, impl: str, backend: str, d: int,
                                n: int) -> None:
    p = _problem(T=11, d=d, n=n, E=5, k=2, dtype=torch.float32, activation=activation)
    out = _run(p, activation, impl=impl, backend=backend)
    ref, ref_leaves = _reference(p, activation)
    assert_close(out, ref, dtype=torch.float32, msg="out")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [p[name] for name in NAMES], grad_out)
    want = torch.autograd.grad(ref, [ref_leaves[name] for name in NAMES], grad_out.double())
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert_close(g, w, grad=True, dtype=torch.float32, msg=name)


def test_unused_expert_bias_grads_are_exact_zeros() -> None:
    p = _problem(T=9, d=4, n=4, E=4, k=2, dtype=torch.float32, activation="swiglu")
    _run(p, GatedActivation.gpt_oss()).sum().backward()  # expert 3 gets no rows
    for name in ("b_up", "b_down", "w_up", "w_down"):
        grad = p[name].grad
        assert grad is not None and torch.equal(grad[3], torch.zeros_like(grad[3])), name
        assert grad[:3].abs().sum() > 0, name


@pytest.mark.parametrize("activation", [GatedActivation.gpt_oss(), "swiglu"])
def test_biases_add_no_saved_activation(activation: object) -> None:
    T, d, n, E, k = 10, 8, 4, 4, 2
    p = _problem(T=T, d=d, n=n, E=E, k=k, dtype=torch.float32, activation=activation)
    params = [p[name] for name in ("w_up", "w_down", "b_up", "b_down")]
    with track_saved_tensors(exclude=params) as saved:
        _run(p, activation)
    S = int(((p["idx"] >= 0) & (p["idx"] < E)).sum())
    floats = sorted(tuple(item.shape) for item in saved.items if item.dtype.is_floating_point)
    assert floats == sorted([(T, d), (S, 2 * n), (T, k)])
    ints = [item for item in saved.items if not item.dtype.is_floating_point]
    assert all(item.dtype == torch.int32 for item in ints)
    assert saved.total_bytes == 4 * (T * d + S * 2 * n + T * k) + 4 * (2 * S + T * k + E + 1)


def test_bias_shape_and_dtype_errors() -> None:
    p = _problem(T=4, d=4, n=2, E=3, k=2, dtype=torch.float32, activation="swiglu")
    index = build_routing_index(p["idx"], 3)
    args = (p["x"], p["weights"], index, p["w_up"], p["w_down"])
    with pytest.raises(ValueError, match=r"b_up must be \(E, G\)=\(3, 4\), got \(3, 5\)"):
        run_experts(*args, b_up_EG=torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"b_down must be \(E, d\)=\(3, 4\)"):
        run_experts(*args, b_down_ED=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="b_down must have hidden_states' dtype"):
        run_experts(*args, b_down_ED=torch.zeros(3, 4, dtype=torch.float64))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"alpha": 0.0}, r"GatedActivation.alpha must be in \(0.0, inf\), got 0.0"),
    ({"limit": -1.0}, r"GatedActivation.limit must be in \(0.0, inf\), got -1.0"),
    ({"gate_fn": "relu"}, "GatedActivation.gate_fn must be one of"),
    ({"gate_fn": "gelu", "alpha": 1.702}, "alpha must be 1.0 with gate_fn='gelu'"),
    ({"up_offset": float("nan")}, "up_offset must be a finite number"),
])
def test_gated_activation_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GatedActivation(**kwargs)  # type: ignore[arg-type]
    assert GatedActivation.from_dict(GatedActivation.gpt_oss().to_dict()) == \
        GatedActivation.gpt_oss()


def test_upcast_computes_in_fp32() -> None:
    h_SG = torch.randn(6, 8).bfloat16()
    gate, up = h_SG.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).bfloat16()
    assert torch.equal(apply_activation(h_SG, GatedActivation(upcast=True)), want)


@triton_cpu  # CPU tensors: the Triton interpreter (devices.py)
def test_triton_backend_with_biases() -> None:
    activation = GatedActivation.gpt_oss(limit=0.5)
    p = _problem(T=6, d=8, n=8, E=3, k=2, dtype=torch.float32, activation=activation)
    out = _run(p, activation, backend="triton")
    ref, ref_leaves = _reference(p, activation)
    assert_close(out, ref, dtype=torch.float32)
    out.sum().backward()
    ref.sum().backward()
    for name in NAMES:
        assert_close(p[name].grad, ref_leaves[name].grad, grad=True, dtype=torch.float32,
                     msg=name)


def test_repeated_expert_within_a_token_gradcheck() -> None:
    """Hash routing may give a token one expert twice; each slot counts once, as in the loop."""
    p = _problem(T=5, d=3, n=2, E=3, k=2, dtype=torch.float64, activation="swiglu")
    p["idx"] = torch.tensor([[0, 0], [1, 2], [2, 2], [0, 3], [1, 1]])
    index = build_routing_index(p["idx"], 3)
    activation = GatedActivation.gpt_oss(limit=0.5)

    def fn(*leaves: torch.Tensor) -> torch.Tensor:
        x, w, up, down, b_up, b_down = leaves
        return run_experts(x, w, index, up, down, b_up_EG=b_up, b_down_ED=b_down,
                           activation=activation, backend="loop")

    leaves = tuple(p[name] for name in NAMES)
    assert torch.autograd.gradcheck(fn, leaves)
    ref, _ = _reference(p, activation)
    assert_close(fn(*leaves), ref)
