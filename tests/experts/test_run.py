"""run_experts (fused and plain, every backend) against memfine.reference.reference_experts.

Outputs and the gradients of x, top_k_weights, w_up and w_down are compared with the float64
per-token loop, in float64 (loop backend), fp32 and bf16, over the docs/style.md §6 edge grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from devices import triton_cpu
from memfine.dispatch import build_routing_index
from memfine.experts import FusedExpertsFunction, FusedOptions, run_experts
from memfine.reference import reference_experts
from tolerances import assert_close

ACTIVATIONS = ["swiglu", "geglu", "gelu", "relu", "silu"]
IMPLS = ["fused", "plain"]


def _backend_param(name: str, dtype: torch.dtype | None = None) -> object:
    """``pytest.param(name)``, or ``(dtype, name)`` with a dtype; skipped where unavailable."""
    marks = []
    if name == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        marks.append(pytest.mark.skip(reason="torch._grouped_mm is not in this torch build"))
    if name == "triton":
        marks.append(triton_cpu)  # CPU tensors: the Triton interpreter (devices.py)
    if dtype is None:
        return pytest.param(name, marks=marks, id=name)
    return pytest.param(dtype, name, marks=marks, id=f"{str(dtype)[6:]}-{name}")


ALL_BACKENDS = ("loop", "grouped_mm", "auto", "triton")
BACKENDS = [_backend_param(b) for b in ALL_BACKENDS]
# float64 on the backends that have it (grouped_mm has no float64), fp32 on every backend.
PRECISIONS = ([_backend_param(b, torch.float64) for b in ("loop", "auto")]
              + [_backend_param(b, torch.float32) for b in ALL_BACKENDS])


@dataclass
class Problem:
    """Float64 master copies of one expert problem; ``cast`` gives leaf tensors in any dtype."""

    x: torch.Tensor
    top_k_index: torch.Tensor
    weights: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    grad_out: torch.Tensor
    activation: str

    @property
    def num_experts(self) -> int:
        return int(self.w_up.shape[0])

    def cast(self, dtype: torch.dtype) -> list[torch.Tensor]:
        return [t.to(dtype).requires_grad_(True)
                for t in (self.x, self.weights, self.w_up, self.w_down)]


def make_problem(T: int, E: int, k: int, d: int, n: int, activation: str = "swiglu",
                 top_k_index: torch.Tensor | None = None) -> Problem:
    gated = activation in ("swiglu", "geglu")
    if top_k_index is None:
        top_k_index = torch.rand(T, E).argsort(-1)[:, :k]  # distinct experts per token
    return Problem(
        x=torch.randn(T, d, dtype=torch.float64),
        top_k_index=top_k_index,
        weights=torch.rand(T, k, dtype=torch.float64) + 0.1,
        w_up=torch.randn(E, d, 2 * n if gated else n, dtype=torch.float64) / d ** 0.5,
        w_down=torch.randn(E, n, d, dtype=torch.float64) / n ** 0.5,
        grad_out=torch.randn(T, d, dtype=torch.float64),
        activation=activation,
    )


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], grad_out: torch.Tensor
           ) -> list[torch.Tensor]:
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True)
    assert all(g is not None for g in grads), "every input must get a gradient tensor"
    return list(grads)


def reference(problem: Problem, dtype: torch.dtype = torch.float64
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Reference output and grads of (x, weights, w_up, w_down), from inputs rounded to dtype."""
    inputs = [t.detach().double().requires_grad_(True) for t in problem.cast(dtype)]
    out = reference_experts(inputs[0], problem.top_k_index, inputs[1], inputs[2], inputs[3],
                            problem.activation)
    return out, _grads(out, inputs, problem.grad_out)


def run(problem: Problem, dtype: torch.dtype, impl: str, backend: str
        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = problem.cast(dtype)
    index = build_routing_index(problem.top_k_index, problem.num_experts)
    out = run_experts(inputs[0], inputs[1], index, inputs[2], inputs[3],
                      activation=problem.activation, impl=impl,  # type: ignore[arg-type]
                      backend=backend)
    return out, _grads(out, inputs, problem.grad_out)


def assert_matches_reference(problem: Problem, dtype: torch.dtype, impl: str, backend: str,
                             *, rounded: bool = False) -> None:
    out, grads = run(problem, dtype, impl, backend)
    ref_out, ref_grads = reference(problem, dtype if rounded else torch.float64)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert_close(out, ref_out, dtype=dtype, msg="out")
    for name, g, ref_g in zip(("x", "top_k_weights", "w_up", "w_down"), grads, ref_grads,
                              strict=True):
        assert_close(g, ref_g, grad=True, dtype=dtype, msg=f"grad {name}")
    counts = torch.bincount(problem.top_k_index.flatten().clamp(0, problem.num_experts),
                            minlength=problem.num_experts + 1)[:problem.num_experts]
    for e in torch.nonzero(counts == 0).flatten().tolist():  # experts with no rows: exact zeros
        assert not grads[2][e].any() and not grads[3][e].any(), f"expert {e} grad not zero"


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dtype", "backend"), PRECISIONS)
def test_matches_reference(dtype: torch.dtype, backend: str, impl: str, activation: str) -> None:
    problem = make_problem(T=8, E=4, k=2, d=8, n=8, activation=activation)
    assert_matches_reference(problem, dtype, impl, backend)


EDGES = [
    pytest.param(dict(T=6, E=4, k=2, d=8, n=8,
                      top_k_index=torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [1, 0], [3, 1]])),
                 id="empty_expert"),
    pytest.param(dict(T=6, E=4, k=1, d=8, n=8, top_k_index=torch.full((6, 1), 2)),
                 id="all_tokens_one_expert"),
    pytest.param(dict(T=6, E=4, k=1, d=8, n=8), id="k1"),
    pytest.param(dict(T=5, E=4, k=4, d=8, n=8), id="k_equals_E"),
    pytest.param(dict(T=0, E=4, k=2, d=8, n=8), id="empty_batch"),
    pytest.param(dict(T=1, E=4, k=2, d=8, n=8), id="T1"),
    pytest.param(dict(T=9, E=7, k=3, d=8, n=8), id="prime_E"),
    pytest.param(dict(T=6, E=3, k=2, d=5, n=3), id="odd_d_n"),
    pytest.param(dict(T=4, E=4, k=2, d=8, n=8,
                      top_k_index=torch.tensor([[0, 4], [4, 4], [-1, 2], [3, 1]])),
                 id="sentinel_ids"),
    pytest.param(dict(T=3, E=4, k=2, d=8, n=8, top_k_index=torch.full((3, 2), 4)),
                 id="all_sentinel_ids"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edge", EDGES)
def test_edge_grid(edge: dict[str, object], backend: str, impl: str) -> None:
    problem = make_problem(**edge)  # type: ignore[arg-type]
    if backend == "grouped_mm" and int(problem.x.shape[1]) % 4:
        with pytest.raises(ValueError, match="gemm backend 'grouped_mm' needs fp32/bf16"):
            run(problem, torch.float32, impl, backend)
        return
    assert_matches_reference(problem, torch.float32, impl, backend)
    if backend in ("loop", "auto"):
        assert_matches_reference(problem, torch.float64, impl, backend)


def test_grouped_mm_rejects_float64() -> None:
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch build")
    problem = make_problem(T=4, E=2, k=1, d=8, n=8)
    with pytest.raises(ValueError, match="gemm backend 'grouped_mm' needs fp32/bf16"):
        run(problem, torch.float64, "fused", "grouped_mm")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_incoming_gradient(backend: str, impl: str) -> None:
    """loss = out.sum() hands backward a non-contiguous (expanded) gradient."""
    problem = make_problem(T=6, E=4, k=2, d=8, n=8)
    problem.grad_out = torch.ones_like(problem.grad_out)
    x, w, up, down = problem.cast(torch.float32)
    index = build_routing_index(problem.top_k_index, 4)
    out = run_experts(x, w, index, up, down, impl=impl, backend=backend)  # type: ignore[arg-type]
    out.sum().backward()
    _, ref_grads = reference(problem)
    for g, ref_g in zip((x.grad, w.grad, up.grad, down.grad), ref_grads, strict=True):
        assert g is not None
        assert_close(g, ref_g, grad=True, dtype=torch.float32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_function_gradcheck(activation: str) -> None:
    problem = make_problem(T=4, E=3, k=2, d=3, n=2, activation=activation,
                           top_k_index=torch.tensor([[0, 2], [1, 3], [2, 1], [0, 1]]))
    index = build_routing_index(problem.top_k_index, 3)
    x, w, up, down = problem.cast(torch.float64)

    def fn(x_: torch.Tensor, w_: torch.Tensor, up_: torch.Tensor, down_: torch.Tensor
           ) -> torch.Tensor:
        return FusedExpertsFunction.apply(
            FusedOptions(activation=activation, backend="loop"), x_, w_,
            index.expert_token_indices, index.expert_token_offsets, index.token_index_map,
            index.expert_slot_indices, up_, down_, None, None, None)

    assert torch.autograd.gradcheck(fn, (x, w, up, down))


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_within_bf16_row(backend: str, impl: str, activation: str) -> None:
    problem = make_problem(T=8, E=4, k=2, d=16, n=16, activation=activation)
    assert_matches_reference(problem, torch.bfloat16, impl, backend, rounded=True)


def test_rejects_bad_arguments() -> None:
    problem = make_problem(T=4, E=2, k=1, d=8, n=8)
    x, w, up, down = problem.cast(torch.float32)
    index = build_routing_index(problem.top_k_index, 2)
    with pytest.raises(ValueError, match=r"^impl must be one of \('fused', 'plain'\), got 'x'$"):
        run_experts(x, w, index, up, down, impl="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^backend must be one of .*got 'cuda'$"):
        run_experts(x, w, index, up, down, backend="cuda")
    with pytest.raises(ValueError, match=r"^activation must be one of .*got 'tanh'$"):
        run_experts(x, w, index, up, down, activation="tanh")
    with pytest.raises(ValueError,
                       match=r"^top_k_weights must be \(T, k\)=\(4, 1\), got \(4, 2\)$"):
        run_experts(x, w.detach().repeat(1, 2), index, up, down)
    with pytest.raises(ValueError, match=r"^w_down must be \(E, n, d\)=\(2, 8, 8\)"):
        run_experts(x, w, index, up, down.detach().transpose(1, 2)[:, :4])
    with pytest.raises(ValueError,
                       match=r"^routing index covers T=4 tokens, hidden_states has T=3$"):
        run_experts(x[:3], w[:3], index, up, down)
