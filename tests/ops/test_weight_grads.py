"""Weight gradients come back in the layout of the weight (transposed HF-style views)."""

from __future__ import annotations

import pytest
import torch

from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.ops import grouped_weight_grad
from tolerances import assert_close


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_transposed_like_gives_the_same_values_in_the_weight_layout(backend: str) -> None:
    S, in_features, out_features, E = 24, 8, 12, 3
    x, dy = torch.randn(S, in_features), torch.randn(S, out_features)
    offsets = torch.tensor([0, 10, 10, S], dtype=torch.int32)
    base_EOI = torch.randn(E, out_features, in_features)  # O: out, I: in features
    plain = grouped_weight_grad(x, dy, offsets, E, backend)
    shaped = grouped_weight_grad(x, dy, offsets, E, backend, like=base_EOI.transpose(1, 2))
    assert_close(shaped, plain)
    assert shaped.transpose(1, 2).is_contiguous()
    assert torch.equal(shaped[1], torch.zeros(in_features, out_features))  # empty: exact zeros


def test_fused_path_on_transposed_parameters_accumulates_in_their_layout() -> None:
    T, D, N, E, k = 10, 8, 4, 4, 2
    gate_up_EGD = torch.randn(E, 2 * N, D, requires_grad=True)
    down_EDN = torch.randn(E, D, N, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    index = build_routing_index(top_k_index, E)
    x, w = torch.randn(T, D), torch.rand(T, k)
    out = run_experts(x, w, index, gate_up_EGD.transpose(1, 2), down_EDN.transpose(1, 2))
    out.square().sum().backward()
    ref_up = gate_up_EGD.detach().transpose(1, 2).contiguous().requires_grad_()
    ref_down = down_EDN.detach().transpose(1, 2).contiguous().requires_grad_()
    run_experts(x, w, index, ref_up, ref_down).square().sum().backward()
    assert gate_up_EGD.grad is not None and gate_up_EGD.grad.is_contiguous()
    assert down_EDN.grad is not None and down_EDN.grad.is_contiguous()
    assert_close(gate_up_EGD.grad, ref_up.grad.transpose(1, 2), grad=True)
    assert_close(down_EDN.grad, ref_down.grad.transpose(1, 2), grad=True)


def _bf16_layer_grads(E: int, block_bytes: int, *, backend: str = "auto",
                      transposed: bool = False) -> tuple[torch.Tensor, ...]:
    """bf16 fused run (several row blocks, experts 0 and E-1 without rows): dW_up, dW_down."""
    torch.manual_seed(0)
    T, D, N, k = 24, 16, 8, 2
    w_up = torch.randn(E, D, 2 * N, dtype=torch.bfloat16)
    w_down = torch.randn(E, N, D, dtype=torch.bfloat16)
    if transposed:  # HF-style (E, O, I) storage
        w_up, w_down = w_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()
    w_up.requires_grad_(), w_down.requires_grad_()
    top_k_index = torch.stack([1 + torch.randperm(E - 2)[:k] for _ in range(T)])
    index = build_routing_index(top_k_index, E)
    x, w = torch.randn(T, D, dtype=torch.bfloat16), torch.rand(T, k, dtype=torch.bfloat16)
    ups, downs = (w_up.transpose(1, 2), w_down.transpose(1, 2)) if transposed else (w_up, w_down)
    out = run_experts(x, w, index, ups, downs, backend=backend,
                      backward_block_bytes=block_bytes)
    out.float().square().sum().backward()
    assert w_up.grad is not None and w_down.grad is not None
    return w_up.grad, w_down.grad


@pytest.mark.parametrize("transposed", [False, True], ids=["EIO", "transposed_EOI"])
@pytest.mark.parametrize("blocks", [1, 5], ids=["one_block", "five_blocks"])
def test_bf16_grouped_weight_grads_equal_the_per_expert_loop(transposed: bool,
                                                             blocks: int) -> None:
    """One grouped GEMM per weight per block (bf16) against the loop backend's addmm_;
    experts without rows get exact zeros."""
    row_bytes = (3 * 16 + 3 * 8 + 16) * 2
    block = 2**40 if blocks == 1 else 10 * row_bytes  # 48 rows: 5 blocks of ≤ 10 rows
    grouped = _bf16_layer_grads(8, block, transposed=transposed)
    loop = _bf16_layer_grads(8, block, backend="loop", transposed=transposed)
    for got, ref in zip(grouped, loop, strict=True):
        assert_close(got, ref, grad=True)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_bf16_weight_grad_calls_do_not_depend_on_the_expert_count() -> None:
    """Per block one 2-D × 2-D ``_grouped_mm`` per weight, in the layout CUDA's kernel takes
    with empty groups (column-major A, row-major B), whatever E is."""
    from memfine.measure.ops_count import OpCounter

    row_bytes = (3 * 16 + 3 * 8 + 16) * 2
    counts = []
    for E in (8, 32):
        with OpCounter() as counter:
            _bf16_layer_grads(E, 10 * row_bytes)
        calls = [c for c in counter.total().grouped_mm if c.layout == "2d-2d"]
        assert len(calls) == 2 * 5 and all(c.fast_path for c in calls)
        assert any(c.empty_groups for c in calls)
        counts.append(counter.total().ops["aten.addmm_.default"])
    assert counts == [0, 0]
