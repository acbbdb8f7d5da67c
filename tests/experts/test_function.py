"""FusedExpertsFunction (and the plain path): values and gradients against the per-token
reference, float64 gradcheck, and the saved-for-backward set (x, H, weights, int32 indices only).

Reference: MoEBlaze §4-§5; docs/design.md §3, §5; docs/style.md §9.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfine.dispatch import RoutingIndex, build_routing_index
from memfine.experts import run_experts
from memfine.measure.saved import track_saved_tensors
from memfine.reference import reference_experts
from tolerances import assert_close

GATED = ("swiglu", "geglu")
ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "silu")


def make_problem(T: int, d: int, n: int, E: int, k: int, *, dtype: torch.dtype = torch.float32,
                 activation: str = "swiglu", sentinels: int = 0, empty_expert: bool = False,
                 ) -> tuple[torch.Tensor, ...]:
    """x (T,d), top_k_index (T,k) int64, weights (T,k), w_up (E,d,G), w_down (E,n,d), leaves.

    ``sentinels`` slots (from the end) get the sentinel id E; ``empty_expert`` keeps expert E-1
    without rows. Weights are scaled so every value is O(1).
    """
    G = 2 * n if activation in GATED else n
    pool = E - 1 if empty_expert else E
    idx_TK = torch.stack([torch.randperm(pool)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    idx_TK.view(-1)[idx_TK.numel() - sentinels:] = E
    x = torch.randn(T, d, dtype=dtype).requires_grad_()
    weights = torch.rand(T, k, dtype=dtype).requires_grad_()
    w_up = (torch.randn(E, d, G, dtype=torch.float64) / d ** 0.5).to(dtype).requires_grad_()
    w_down = (torch.randn(E, n, d, dtype=torch.float64) / n ** 0.5).to(dtype).requires_grad_()
    return x, idx_TK, weights, w_up, w_down


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation: str) -> None:
    T, d, n, E, k = 5, 3, 2, 4, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, dtype=torch.float64,
                                           activation=activation, sentinels=1, empty_expert=True)
    index = build_routing_index(idx, E)

    def fn(x_: torch.Tensor, w_: torch.Tensor, up_: torch.Tensor, down_: torch.Tensor
           ) -> torch.Tensor:
        return run_experts(x_, w_, index, up_, down_, activation=activation, backend="loop")

    assert torch.autograd.gradcheck(fn, (x, w, w_up, w_down))


@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(("dtype", "backend", "d", "n"), [
    pytest.param(torch.float64, "loop", 6, 5, id="float64-loop-odd_d_n"),
    pytest.param(torch.float32, "loop", 6, 5, id="float32-loop-odd_d_n"),
    pytest.param(torch.float32, "grouped_mm", 8, 12, id="float32-grouped_mm"),
    pytest.param(torch.float32, "auto", 6, 12, id="float32-auto-unaligned"),
])
def test_matches_reference(impl: str, activation: str, dtype: torch.dtype, backend: str,
                           d: int, n: int) -> None:
    T, E, k = 13, 5, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, dtype=dtype, activation=activation,
                                           sentinels=3, empty_expert=True)
    index = build_routing_index(idx, E)
    inputs = (x, w, w_up, w_down)
    out = run_experts(x, w, index, w_up, w_down, activation=activation, impl=impl,  # type: ignore[arg-type]
                      backend=backend)
    grad_out = torch.randn_like(out)
    ref = reference_experts(*(t.double() for t in (x,)), idx, w.double(), w_up.double(),
                            w_down.double(), activation)
    assert_close(out, ref, dtype=dtype, msg="out")
    for name, got, want in zip(("x", "weights", "w_up", "w_down"), _grads(out, inputs, grad_out),
                               _grads(ref, inputs, grad_out.double()), strict=True):
        assert_close(got, want, grad=True, dtype=dtype, msg=name)


def test_bf16_matches_reference() -> None:
    T, d, n, E, k = 9, 16, 8, 4, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, dtype=torch.bfloat16, sentinels=2)
    index = build_routing_index(idx, E)
    inputs = (x, w, w_up, w_down)
    out = run_experts(x, w, index, w_up, w_down)
    ref = reference_experts(x.double(), idx, w.double(), w_up.double(), w_down.double())
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, dtype=torch.bfloat16)
    grad_out = torch.randn_like(out)
    for got, want in zip(_grads(out, inputs, grad_out),
                         _grads(ref, inputs, grad_out.double()), strict=True):
        assert_close(got, want, grad=True, dtype=torch.bfloat16)


@pytest.mark.parametrize("needs", ["x", "weights", "w_up", "w_down"])
def test_partial_input_grads(needs: str) -> None:
    """Each input alone requiring grad (the needs_input_grad branches) gets the reference grad."""
    T, d, n, E, k = 7, 8, 4, 3, 2
    tensors = dict(zip(("x", "idx", "weights", "w_up", "w_down"),
                       make_problem(T, d, n, E, k, sentinels=1), strict=True))
    for name in ("x", "weights", "w_up", "w_down"):
        tensors[name] = tensors[name].detach().requires_grad_(name == needs)
    index = build_routing_index(tensors["idx"], E)
    out = run_experts(tensors["x"], tensors["weights"], index, tensors["w_up"], tensors["w_down"])
    ref = reference_experts(tensors["x"], tensors["idx"], tensors["weights"], tensors["w_up"],
                            tensors["w_down"])
    grad_out = torch.randn_like(out)
    (got,) = _grads(out, (tensors[needs],), grad_out)
    (want,) = _grads(ref, (tensors[needs],), grad_out)
    assert_close(got, want, grad=True)


def _index_bytes(index: RoutingIndex) -> int:
    """int32 arrays the fused Function saves: expert_token_indices, expert_slot_indices (S),
    token_index_map (T·k), expert_token_offsets (E + 1)."""
    S, T, k, E = index.num_rows, index.num_tokens, index.top_k, index.num_experts
    return 4 * (2 * S + T * k + E + 1)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_saves_only_x_h_weights_and_indices(activation: str, backend: str) -> None:
    T, d, n, E, k = 12, 8, 16, 4, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, activation=activation, sentinels=3)
    index = build_routing_index(idx, E)
    S, G = index.num_rows, w_up.shape[-1]
    with track_saved_tensors(exclude=[w_up, w_down]) as saved:
        run_experts(x, w, index, w_up, w_down, activation=activation, backend=backend)
    floats = {(item.shape, item.dtype) for item in saved.items if item.dtype.is_floating_point}
    ints = [item for item in saved.items if not item.dtype.is_floating_point]
    assert floats == {((T, d), torch.float32), ((S, G), torch.float32), ((T, k), torch.float32)}
    assert all(item.dtype == torch.int32 for item in ints)
    assert sorted(item.shape for item in ints) == sorted([(S,), (S,), (T, k), (E + 1,)])
    assert saved.total_bytes == 4 * (T * d + S * G + T * k) + _index_bytes(index)


def test_plain_path_saves_copies() -> None:
    """The plain path keeps the gathered x, A and the (T, k, d) scattered copy; fused does not."""
    T, d, n, E, k = 12, 8, 16, 4, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k)
    index = build_routing_index(idx, E)
    S = index.num_rows
    with track_saved_tensors(exclude=[w_up, w_down]) as plain:
        run_experts(x, w, index, w_up, w_down, impl="plain")
    shapes = {item.shape for item in plain.items}
    assert {(S, d), (S, n), (T, k, d)} <= shapes
    assert plain.total_bytes >= 4 * (T * d + S * d + 2 * S * n + S * n + T * k * d)


@pytest.mark.parametrize(("dtype", "backend"), [
    pytest.param(torch.float32, "auto", id="float32"),  # auto → loop for fp32 fake tensors
    pytest.param(torch.bfloat16, "grouped_mm", id="bfloat16"),
])
def test_saved_bytes_budget_issue_size(dtype: torch.dtype, backend: str) -> None:
    """T=4096, d=512, n=1024, E=16, k=4: saved ≤ 1.02·(T·d + 2·T·k·n)·D_t + indices + weights.

    Runs under FakeTensorMode (shapes only; the index is built for real, then faked).
    """
    T, d, n, E, k = 4096, 512, 1024, 16, 4
    top_k_index = torch.rand(T, E).topk(k).indices
    real_index = build_routing_index(top_k_index, E)
    D_t = torch.empty((), dtype=dtype).element_size()
    with FakeTensorMode() as mode:
        index = RoutingIndex(**{
            name: mode.from_tensor(getattr(real_index, name)) for name in (
                "expert_token_indices", "expert_token_offsets", "token_expert_indices",
                "token_index_map", "expert_slot_indices")}, num_experts=E)
        x = torch.empty(T, d, dtype=dtype, requires_grad=True)
        weights = torch.empty(T, k, dtype=dtype, requires_grad=True)
        w_up = torch.empty(E, d, 2 * n, dtype=dtype, requires_grad=True)
        w_down = torch.empty(E, n, d, dtype=dtype, requires_grad=True)
        with track_saved_tensors(exclude=[w_up, w_down]) as saved:
            out = run_experts(x, weights, index, w_up, w_down, backend=backend)
        assert out.shape == (T, d)
    floor_bytes = (T * d + 2 * T * k * n) * D_t
    budget_bytes = 1.02 * floor_bytes + _index_bytes(real_index) + T * k * D_t
    assert saved.total_bytes <= budget_bytes, saved.table()
    assert saved.total_bytes >= floor_bytes, saved.table()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"impl": "eager"}, "impl must be one of"),
    ({"backend": "cutlass"}, "backend must be one of"),
    ({"activation": "tanh"}, "activation must be one of"),
])
def test_rejects_bad_options(kwargs: dict[str, str], match: str) -> None:
    x, idx, w, w_up, w_down = make_problem(4, 8, 4, 3, 2)
    with pytest.raises(ValueError, match=match):
        run_experts(x, w, build_routing_index(idx, 3), w_up, w_down, **kwargs)  # type: ignore[arg-type]


def test_rejects_bad_shapes() -> None:
    x, idx, w, w_up, w_down = make_problem(4, 8, 4, 3, 2)
    index = build_routing_index(idx, 3)
    with pytest.raises(ValueError, match="w_down must be"):
        run_experts(x, w, index, w_up, w_down[:, :3])
    with pytest.raises(ValueError, match="top_k_weights must be"):
        run_experts(x, w[:, :1], index, w_up, w_down)
    with pytest.raises(ValueError, match="routing index covers"):
        run_experts(x[:3], w[:3], index, w_up, w_down)
