"""Cases from the bug-report cases on the fused expert path (ids are the case ids).

Reference: bug-report cases empty-expert-grads, nan-padding, determinism, empty-batch;
docs/style.md §6.
"""

from __future__ import annotations

import pytest
import torch

from memfine.activations import apply_activation
from memfine.config import MoEConfig
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.nn import MoELayer
from memfine.ops.combine import gather_rows
from memfine.ops.grouped import grouped_mm
from memfine.reference import reference_experts
from tolerances import assert_close

BACKENDS = ("grouped_mm", "loop")


def _weights(E: int, d: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w_up = (torch.randn(E, d, 2 * n) / d ** 0.5).to(dtype).requires_grad_()
    w_down = (torch.randn(E, n, d) / n ** 0.5).to(dtype).requires_grad_()
    return w_up, w_down


def _fp32_problem(T: int, d: int, n: int, E: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 expert weights and a (T, k) routing with k distinct random experts per token."""
    w_up, w_down = _weights(E, d, n, torch.float32)
    return w_up, w_down, torch.stack([torch.randperm(E)[:k] for _ in range(T)])


def _routing_for_group_sizes() -> torch.Tensor:
    """T=5, k=2, E=5 routing whose per-expert row counts are [3, 0, 5, 2, 0]."""
    return torch.tensor([[2, 0], [0, 2], [2, 0], [3, 2], [2, 3]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("all_empty", [
    pytest.param(False, id="empty-expert-grads"),
    pytest.param(True, id="empty-expert-grads-all-empty"),
])
def test_empty_expert_grads(all_empty: bool, dtype: torch.dtype, backend: str) -> None:
    T, d, n, E, k = 5, 8, 16, 5, 2
    w_up, w_down = _weights(E, d, n, dtype)
    x = torch.randn(T, d, dtype=dtype).requires_grad_()
    weights = torch.rand(T, k, dtype=dtype).requires_grad_()
    # First a pass in which every expert gets rows, so stale buffer contents would show up.
    warm = torch.tensor([[0, 1], [2, 3], [4, 0], [1, 2], [3, 4]])
    run_experts(x, weights, build_routing_index(warm, E), w_up, w_down,
                backend=backend).sum().backward()
    for t in (x, weights, w_up, w_down):
        t.grad = None
    idx = torch.full((T, k), E) if all_empty else _routing_for_group_sizes()
    index = build_routing_index(idx, E)
    expected_sizes = [0] * E if all_empty else [3, 0, 5, 2, 0]
    assert index.tokens_per_expert().tolist() == expected_sizes
    out = run_experts(x, weights, index, w_up, w_down, backend=backend)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    empty = [e for e in range(E) if expected_sizes[e] == 0]
    for grad in (w_up.grad, w_down.grad):
        assert grad is not None and torch.isfinite(grad).all()
        assert torch.equal(grad[empty], torch.zeros_like(grad[empty]))
    leaves = [t.detach().float().requires_grad_() for t in (x, weights, w_up, w_down)]
    ref = reference_experts(leaves[0], idx, *leaves[1:])
    ref.backward(grad_out.float())
    assert_close(out, ref.detach(), dtype=dtype)
    for got, leaf in zip((x.grad, weights.grad, w_up.grad, w_down.grad), leaves, strict=True):
        assert got is not None and leaf.grad is not None
        assert_close(got, leaf.grad, grad=True, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["nan-padding"])
def test_nan_padding(case: str, backend: str) -> None:
    """8 of 16 slots are padding: sentinel ids, NaN weights, and NaN rows for padding tokens."""
    T, d, n, E, k = 8, 4, 8, 4, 2
    w_up, w_down, idx = _fp32_problem(T, d, n, E, k)
    pad_TK = torch.zeros(T, k, dtype=torch.bool)
    pad_TK[6:] = True  # tokens 6, 7: every slot is padding (4 slots)
    pad_TK[:4, 1] = True  # tokens 0-3: second slot is padding (4 slots)
    assert int(pad_TK.sum()) == 8
    idx = torch.where(pad_TK, E, idx)
    x = torch.randn(T, d)
    x[6:] = float("nan")  # padding tokens' rows are garbage
    x.requires_grad_()
    weights = torch.where(pad_TK, float("nan"), torch.rand(T, k)).requires_grad_()
    out = run_experts(x, weights, build_routing_index(idx, E), w_up, w_down, backend=backend)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, weights, w_up, w_down), grad_out)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))
    assert torch.equal(grads[0][6:], torch.zeros_like(grads[0][6:]))
    assert torch.equal(grads[1][pad_TK], torch.zeros(8))
    ref = reference_experts(x, idx, weights, w_up, w_down)
    ref_grads = torch.autograd.grad(ref, (x, weights, w_up, w_down), grad_out)
    assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        # NaN-free references: padding slots get zero gradient in both.
        assert_close(torch.nan_to_num(got), torch.nan_to_num(want), grad=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["determinism"])
def test_determinism(case: str, backend: str) -> None:
    T, d, n, E, k = 16, 32, 16, 8, 4
    w_up, w_down, idx = _fp32_problem(T, d, n, E, k)
    x = torch.randn(T, d).requires_grad_()
    weights = torch.rand(T, k).requires_grad_()
    grad_out = torch.randn(T, d)
    index = build_routing_index(idx, E)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(10):
            out = run_experts(x, weights, index, w_up, w_down, backend=backend)
            runs.append((out.detach(), *torch.autograd.grad(out, (x, weights, w_up, w_down),
                                                            grad_out)))
    finally:
        torch.use_deterministic_algorithms(previous)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))
    # On the CPU the combine adds each token's weighted rows into zeros one at a time, in
    # expert-grouped row order (the streamed forward's index_add_).
    with torch.no_grad():
        h_SG = grouped_mm(gather_rows(x, index.expert_token_indices), w_up,
                          index.expert_token_offsets, backend)
        y_SD = grouped_mm(apply_activation(h_SG, "swiglu"), w_down, index.expert_token_offsets,
                          backend)
        slots = index.expert_slot_indices.long()
        weighted_SD = y_SD * weights.reshape(-1)[slots][:, None]
        want = torch.zeros(T, d)
        for r, t in enumerate(index.expert_token_indices.tolist()):
            want[t] = want[t] + weighted_SD[r]
    assert torch.equal(runs[0][0], want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["empty-batch"])
def test_empty_batch(case: str, backend: str) -> None:
    d, n, E, k = 8, 4, 4, 2
    w_up, w_down = _weights(E, d, n, torch.float32)
    x = torch.randn(0, d, requires_grad=True)
    weights = torch.rand(0, k, requires_grad=True)
    index = build_routing_index(torch.zeros(0, k, dtype=torch.int64), E)
    out = run_experts(x, weights, index, w_up, w_down, backend=backend)
    assert out.shape == (0, d)
    out.sum().backward()
    for t in (w_up, w_down):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))
    assert x.grad is not None and x.grad.shape == (0, d)
    assert weights.grad is not None and weights.grad.shape == (0, k)


@pytest.mark.parametrize("case", ["empty-batch"])
def test_empty_batch_layer(case: str) -> None:
    """The MoE layer on the fused path: router and expert weights get zero grads, not None."""
    config = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                       experts_impl="fused")
    layer = MoELayer(config)
    x = torch.randn(0, 8, requires_grad=True)
    out, aux = layer(x)
    assert out.shape == (0, 8)
    out.sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None, name
        assert torch.equal(param.grad, torch.zeros_like(param)), name
