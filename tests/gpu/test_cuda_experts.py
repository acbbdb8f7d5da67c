"""Expert math on CUDA: every GEMM backend and the fused Function against the float64 reference.

Shapes have an empty expert and ragged tails (row counts that are no multiple of any tile), in
bf16 and fp32. ``grouped_mm`` is torch._grouped_mm's CUDA kernel, ``triton`` the native memfine
kernels, ``loop`` one matmul per expert. Reference: docs/style.md §6 (values, not "it runs").
"""

from __future__ import annotations

import pytest
import torch

from devices import gpu, triton_gpu
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.ops.grouped import grouped_mm, grouped_mm_supported
from memfine.reference import reference_experts
from tolerances import assert_close

pytestmark = gpu
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
BACKENDS = [pytest.param("grouped_mm", id="grouped_mm"), pytest.param("loop", id="loop"),
            pytest.param("triton", id="triton", marks=triton_gpu)]
T, E, K, D, N = 203, 8, 2, 128, 96  # 203·2 rows over 7 experts: ragged tails everywhere


def _top_k_index() -> torch.Tensor:
    """(T, k) distinct experts per token; expert E-1 receives no row."""
    return torch.rand(T, E - 1).argsort(-1)[:, :K]


def _leaves(dtype: torch.dtype) -> list[torch.Tensor]:
    leaves = [torch.randn(T, D), torch.rand(T, K) + 0.1, torch.randn(E, D, 2 * N) / D**0.5,
              torch.randn(E, N, D) / N**0.5]
    return [t.to(dtype) for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_backends_match_float64(backend: str, dtype: torch.dtype) -> None:
    index = build_routing_index(_top_k_index().cuda(), E)
    S = index.num_rows
    x_SI = torch.randn(S, D, device="cuda").to(dtype)
    w_EIO = (torch.randn(E, D, N, device="cuda") / D**0.5).to(dtype)
    got = grouped_mm(x_SI, w_EIO, index.expert_token_offsets, backend)
    offsets = index.expert_token_offsets.tolist()
    want = torch.cat([x_SI[a:b].double() @ w_EIO[e].double()
                      for e, (a, b) in enumerate(zip(offsets, offsets[1:], strict=False))])
    assert got.dtype == dtype and got.device.type == "cuda"
    assert_close(got.double(), want, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", ["fused", "plain"])
def test_experts_forward_backward_match_float64(impl: str, backend: str,
                                                dtype: torch.dtype) -> None:
    idx = _top_k_index()
    leaves = [t.cuda().requires_grad_() for t in _leaves(dtype)]
    out = run_experts(leaves[0], leaves[1], build_routing_index(idx.cuda(), E), *leaves[2:],
                      impl=impl, backend=backend)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref = reference_experts(ref_leaves[0], idx, *ref_leaves[1:])
    assert_close(out.double().cpu(), ref.detach(), dtype=dtype)
    grad = torch.randn(T, D, dtype=torch.float64)
    out.backward(grad.to(dtype).cuda())
    ref.backward(grad.to(dtype).double())
    for name, got, want in zip(("x", "top_k_weights", "w_up", "w_down"), leaves, ref_leaves,
                               strict=True):
        assert got.grad is not None and want.grad is not None
        assert_close(got.grad.double().cpu(), want.grad, grad=True, dtype=dtype, msg=name)
    assert torch.equal(leaves[2].grad[E - 1], torch.zeros_like(leaves[2].grad[E - 1]))
    assert torch.equal(leaves[3].grad[E - 1], torch.zeros_like(leaves[3].grad[E - 1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_plain(dtype: torch.dtype) -> None:
    idx = _top_k_index().cuda()
    base = [t.cuda() for t in _leaves(dtype)]
    results = []
    for impl in ("fused", "plain"):
        leaves = [t.clone().requires_grad_() for t in base]
        out = run_experts(leaves[0], leaves[1], build_routing_index(idx, E), *leaves[2:],
                          impl=impl, backend="grouped_mm")
        out.backward(torch.ones_like(out))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for got, want in zip(*results, strict=True):
        assert_close(got.double(), want.double(), grad=True, dtype=dtype)


def test_bf16_grouped_mm_calls_take_the_cuda_kernel() -> None:
    """The bf16 operands memfine hands torch._grouped_mm (empty expert included) are accepted."""
    index = build_routing_index(_top_k_index().cuda(), E)
    x_SI = torch.randn(index.num_rows, D, device="cuda", dtype=torch.bfloat16)
    w_EIO = torch.randn(E, D, 2 * N, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_supported(x_SI, w_EIO)
    got = torch._grouped_mm(x_SI, w_EIO, offs=index.expert_token_offsets[1:])
    want = grouped_mm(x_SI, w_EIO, index.expert_token_offsets, "loop")
    assert_close(got.double(), want.double(), dtype=torch.bfloat16)
