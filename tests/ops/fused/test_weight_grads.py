"""Weight gradients come back in the layout of the weight (transposed HF-style views)."""

from __future__ import annotations

import pytest
import torch

from memfine.dispatch import build_routing_index
from memfine.ops import grouped_weight_grad, run_experts
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
