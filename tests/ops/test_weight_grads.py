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


def _bf16_layer_grads(E: int, block_rows: int, *, backend: str = "auto",
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
                      block_rows=block_rows)
    out.float().square().sum().backward()
    assert w_up.grad is not None and w_down.grad is not None
    return w_up.grad, w_down.grad


@pytest.mark.parametrize("transposed", [False, True], ids=["EIO", "transposed_EOI"])
@pytest.mark.parametrize("blocks", [1, 5], ids=["one_block", "five_blocks"])
def test_bf16_grouped_weight_grads_equal_the_per_expert_loop(transposed: bool,
                                                             blocks: int) -> None:
    """One grouped GEMM per weight per block (bf16) against the loop backend's addmm_;
    experts without rows get exact zeros."""
    block = 2**40 if blocks == 1 else 10  # 48 rows: 5 blocks of ≤ 10 rows
    grouped = _bf16_layer_grads(8, block, transposed=transposed)
    loop = _bf16_layer_grads(8, block, backend="loop", transposed=transposed)
    for got, ref in zip(grouped, loop, strict=True):
        assert_close(got, ref, grad=True)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_bf16_weight_grads_are_written_once_without_products_to_copy() -> None:
    """Per weight, a first block of at least half the rows computes one 2-D × 2-D
    ``_grouped_mm`` over all E experts, in the layout CUDA's kernel takes (column-major A,
    row-major B), which is the gradient buffer itself; every other block writes its whole
    experts with per-expert ``addmm_`` straight into their slices (no product, no copy), and
    experts cut by a block edge add fp32 products."""
    from memfine.counts.ops_count import OpCounter

    for E, rows, first_grouped in ((8, 10, False), (32, 10, False), (8, 24, True)):
        with OpCounter() as counter:
            _bf16_layer_grads(E, rows)  # S = 48 rows
        total = counter.total()
        calls = [c for c in total.grouped_mm if c.layout == "2d-2d"]
        assert [c.groups for c in calls] == ([E, E] if first_grouped else [])
        assert all(c.fast_path for c in calls)
        assert total.ops["aten.addmm_.default"] > 0 and total.ops["aten.mm.default"] > 0
        blocks = -(-48 // rows)  # backward copies: only cut experts' fp32 sums, rounded once
        assert counter.counts["backward"].ops["aten.copy_.default"] <= 2 * (blocks - 1)


def _blocked_weight_grad(x_SI: torch.Tensor, dy_SO: torch.Tensor, bounds: list[int],
                         block_rows: int, like: torch.Tensor, backend: str) -> torch.Tensor:
    """WeightGradBuffers.write_block_ over row blocks of ``block_rows`` (the fused backward's
    calls), handed over with ``take``."""
    from memfine.ops.weight_grads import WeightGradBuffers

    buffers, S = WeightGradBuffers(), x_SI.shape[0]
    offsets = torch.tensor(bounds, dtype=torch.int32)
    for r0 in range(0, S, block_rows):
        r1 = min(S, r0 + block_rows)
        block_offsets = (offsets - r0).clamp(0, r1 - r0).to(torch.int32)
        buffers.write_block_(0, like, x_SI[r0:r1], dy_SO[r0:r1], bounds, r0, block_offsets,
                             backend)
    return buffers.take(0, like)


@pytest.mark.parametrize("backend", ["auto", "loop"], ids=["grouped", "per_expert"])
def test_bf16_expert_spanning_blocks_is_rounded_once(backend: str) -> None:
    """An expert whose rows span three blocks, with per-block products that cancel (+1000s
    then −1000s), gets its float64 gradient within one bf16 rounding (fp32 sums, rounded
    once), as one block gets it; a per-block bf16 sum would be off by a rounding of 1000s."""
    torch.manual_seed(0)
    width = 8  # 16-byte bf16 rows: the grouped form unless the loop backend is chosen
    bounds = [0, 3, 13, 16]  # expert 1: rows 3..12, cut by blocks of 5 rows
    x = torch.randn(16, width).to(torch.bfloat16)
    dy = torch.randn(16, width)
    dy[3:8] += 300.0  # block 0 and 1 rows of expert 1: large positive products
    dy[8:13] -= 300.0  # its later rows: large negative ones
    x[3:13] = x[3:13].abs() + 1
    dy = dy.to(torch.bfloat16)
    like = torch.empty(3, width, width, dtype=torch.bfloat16)
    ref = torch.stack([x[a:b].double().t() @ dy[a:b].double()
                       for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    terms = torch.stack([x[a:b].double().abs().t() @ dy[a:b].double().abs()
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    one_rounding = ref.abs() * 2.0**-8 + terms * 2.0**-20  # bf16 rounding + fp32 sums
    for block_rows in (5, 16):  # blocks cutting expert 1 twice; one block
        got = _blocked_weight_grad(x, dy, bounds, block_rows, like, backend).double()
        assert bool(((got - ref).abs() <= one_rounding).all()), (block_rows,
                                                                 (got - ref).abs().max())


def test_unused_experts_get_zeros_and_chunks_equal_one_call_in_bf16() -> None:
    """Several row blocks, experts 0 and E-1 without rows: zero gradients (not None); the
    layer chunked into c = 2 token chunks gives the unchunked weight gradients."""
    from memfine.config import ChunkConfig, MoEConfig
    from memfine.nn import MoELayer

    torch.manual_seed(0)
    up, down = _bf16_layer_grads(8, 7)
    for g in (up, down):
        assert torch.equal(g[0], torch.zeros_like(g[0]))
        assert torch.equal(g[-1], torch.zeros_like(g[-1]))
    moe = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=6, top_k=2,
                    backward_block_bytes=7 * (3 * 16 + 3 * 8 + 16) * 2)
    grads = []
    for c in (1, 2):
        torch.manual_seed(1)
        layer = MoELayer(moe, chunk=ChunkConfig(num_chunks=c, recompute="experts"))
        layer = layer.to(torch.bfloat16)
        x = torch.randn(32, 16, dtype=torch.bfloat16)
        out, _ = layer(x)
        out.float().square().sum().backward()
        grads.append([p.grad for p in layer.experts.parameters()])
    for chunked, whole in zip(grads[1], grads[0], strict=True):
        assert chunked is not None and whole is not None
        assert_close(chunked, whole, grad=True)
