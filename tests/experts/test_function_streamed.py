"""The fused forward and backward streamed over row blocks, and weight gradients shared across
chunks.

Blocks of 1, 3 and 7 rows cut experts anywhere; every block size must give the reference values
(float64 gradcheck; fp32 against the float64 reference) and the one-block result. Shared
weight-gradient buffers must still reach the parameters through AccumulateGrad (``.grad``
accumulation and post-accumulate hooks, once per call), with exact zeros for unused experts.

Reference: MoEBlaze §4.2 (tiles of the expert-grouped rows); MemFine §4; docs/style.md §6, §9.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from test_function import make_problem

from memfine.config import (
    CUDA_BACKWARD_BLOCK_BYTES,
    DEFAULT_BACKWARD_BLOCK_BYTES,
    MIN_BLOCK_ROWS,
    ChunkConfig,
    MoEConfig,
    backward_block_rows,
    default_block_bytes,
)
from memfine.config import moe as config_moe
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.measure import PeakMemoryTracker
from memfine.nn import MoELayer
from memfine.ops.grouped import grouped_weight_grad
from memfine.ops.weight_grads import accumulate_grouped_weight_grad_
from memfine.reference import reference_experts
from tolerances import assert_close


def _row_bytes(d: int, n: int, G: int, dtype_bytes: int) -> int:
    return (3 * d + 3 * n + G) * dtype_bytes


def test_block_rows_from_bytes() -> None:
    assert backward_block_rows(_row_bytes(8, 4, 8, 4) * 3 + 5, 8, 4, 8, 4) == 3
    assert backward_block_rows(1, 8, 4, 8, 4) == 1  # never 0 rows
    for bad in (0, -5, 2.5, True, 2**63):
        with pytest.raises(ValueError, match=rf"block_bytes .* got {re.escape(repr(bad))}"):
            backward_block_rows(bad, 8, 4, 8, 4)  # type: ignore[arg-type]


def test_default_sized_blocks_hold_at_least_min_block_rows() -> None:
    # d 1024, n 4096 gated fp32: a row is 92 KiB, so 16 MiB alone would give 178 rows
    d, n = 1024, 4096
    row = _row_bytes(d, n, 2 * n, 4)
    assert DEFAULT_BACKWARD_BLOCK_BYTES // row == 178
    assert backward_block_rows(None, d, n, 2 * n, 4) == MIN_BLOCK_ROWS  # the default, as such
    # a set target is taken as it is, whatever its bytes: the default is None, not 16 MiB
    for target in (DEFAULT_BACKWARD_BLOCK_BYTES, DEFAULT_BACKWARD_BLOCK_BYTES + 1):
        assert backward_block_rows(target, d, n, 2 * n, 4) == 178
    assert backward_block_rows(32 * 2**20, d, n, 2 * n, 4) == 356  # a set target as it is
    assert backward_block_rows(64 * 2**20, d, n, 2 * n, 4) == 712
    assert backward_block_rows(DEFAULT_BACKWARD_BLOCK_BYTES - 1, d, n, 2 * n, 4) == 178
    assert backward_block_rows(4 * 2**20, d, n, 2 * n, 4) == 44  # small targets as they are
    # a layer whose 16 MiB holds more rows keeps them up to the CPU's cap (d 512, n 1024: 630;
    # d 512, n 128: 1,927 capped to 1,024); the cap is the CPU's only
    assert backward_block_rows(None, 512, 1024, 2048, 4) == (
        16 * 2**20 // _row_bytes(512, 1024, 2048, 4)) == 630
    assert 16 * 2**20 // _row_bytes(512, 128, 256, 4) == 1927
    assert backward_block_rows(None, 512, 128, 256, 4) == 1024
    assert backward_block_rows(None, 512, 128, 256, 4, "cuda") == (
        512 * 2**20 // _row_bytes(512, 128, 256, 4))


def test_default_block_is_sized_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """None: 16 MiB on the CPU; on a CUDA device of unknown memory (none here) 512 MiB, a
    handful of blocks at the Qwen3-30B-A3B layer at T 16384 in bf16 (S = 131,072 rows of
    (3·2048 + 3·768 + 1536)·2 bytes)."""
    assert MoEConfig(hidden_size=8, intermediate_size=4, num_experts=3,
                     top_k=2).backward_block_bytes is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d, n, S = 2048, 768, 16384 * 8
    cpu = backward_block_rows(None, d, n, 2 * n, 2)
    assert cpu == backward_block_rows(DEFAULT_BACKWARD_BLOCK_BYTES, d, n, 2 * n, 2)
    cuda = backward_block_rows(None, d, n, 2 * n, 2, "cuda")
    assert cuda == backward_block_rows(CUDA_BACKWARD_BLOCK_BYTES, d, n, 2 * n, 2)
    assert 3 <= -(-S // cuda) <= 8 < -(-S // cpu)


READ_CUDA_MEMORY = config_moe._cuda_memory


def test_cuda_default_block_follows_the_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the default block is the device's memory ÷ 32, at least 512 MiB; unknown memory
    (no CUDA here) gives 512 MiB; the CPU's is 16 MiB whatever the memory."""
    h200, h100 = 141 * 10**9, 80 * 10**9
    assert default_block_bytes("cuda", h200) == h200 // 32 == 4_406_250_000
    assert default_block_bytes("cuda", h100) == 2_500_000_000
    assert default_block_bytes("cuda", 16 * 2**30) == CUDA_BACKWARD_BLOCK_BYTES
    assert default_block_bytes("cpu", h200) == DEFAULT_BACKWARD_BLOCK_BYTES
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_block_bytes("cuda") == CUDA_BACKWARD_BLOCK_BYTES
    props = type("Props", (), {"total_memory": h200})
    monkeypatch.setattr(config_moe, "_cuda_memory", READ_CUDA_MEMORY)  # conftest's: unknown
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    # the Qwen3-30B-A3B layer at T 16384 in bf16 (131,072 rows) runs in one block on an H200
    d, n = 2048, 768
    assert backward_block_rows(None, d, n, 2 * n, 2, "cuda") == h200 // 32 // (
        (3 * d + 3 * n + 2 * n) * 2) >= 16384 * 8
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"total_memory must be a positive int"):
            default_block_bytes("cuda", bad)  # type: ignore[arg-type]


def test_triton_backend_without_cuda_or_interpreter_is_refused_at_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"MoEConfig.gemm_backend must be 'auto', 'grouped_mm' "
                                         r"or 'loop' on a machine without CUDA .*got 'triton'"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=3, top_k=2,
                  gemm_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert MoEConfig(hidden_size=8, intermediate_size=4, num_experts=3, top_k=2,
                     gemm_backend="triton").gemm_backend == "triton"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gradcheck_float64_blocks(rows: int, activation: str) -> None:
    T, d, n, E, k = 5, 3, 2, 4, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, dtype=torch.float64,
                                           activation=activation, sentinels=1, empty_expert=True)
    index = build_routing_index(idx, E)

    def fn(x_: torch.Tensor, w_: torch.Tensor, up_: torch.Tensor, down_: torch.Tensor
           ) -> torch.Tensor:
        return run_experts(x_, w_, index, up_, down_, activation=activation, backend="loop",
                           block_rows=rows)

    assert torch.autograd.gradcheck(fn, (x, w, w_up, w_down))


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_blocks_match_reference_and_one_block(rows: int, backend: str) -> None:
    T, d, n, E, k = 13, 8, 12, 5, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, sentinels=3, empty_expert=True)
    b_up = torch.randn(E, 2 * n, requires_grad=True)
    b_down = torch.randn(E, d, requires_grad=True)
    index = build_routing_index(idx, E)
    inputs = (x, w, w_up, w_down, b_up, b_down)
    grad_out = torch.randn(T, d)

    def grads(block_rows: int) -> tuple[torch.Tensor, ...]:
        out = run_experts(x, w, index, w_up, w_down, backend=backend, b_up_EG=b_up,
                          b_down_ED=b_down, block_rows=block_rows)
        return (out, *torch.autograd.grad(out, inputs, grad_out))

    streamed, whole = grads(rows), grads(2**40)
    for name, got, want in zip(("out", "x", "w", "w_up", "w_down", "b_up", "b_down"), streamed,
                               whole, strict=True):
        assert_close(got, want, grad=name != "out", msg=name)
    ref = reference_experts(x.double(), idx, w.double(), w_up.double(), w_down.double(),
                            b_up_EG=b_up.double(), b_down_ED=b_down.double())
    assert_close(streamed[0], ref.float(), msg="out vs reference")
    ref_grads = torch.autograd.grad(ref, inputs[:4], grad_out.double())
    for name, got, want in zip(("x", "w", "w_up", "w_down"), streamed[1:5], ref_grads,
                               strict=True):
        assert_close(got, want, grad=True, msg=name)
    assert torch.equal(streamed[4][E - 1], torch.zeros_like(streamed[4][E - 1]))  # no rows


def test_accumulate_matches_grouped_weight_grad() -> None:
    """Block-wise addmm_ into a transposed buffer equals one grouped weight gradient."""
    S, n_in, n_out, E = 11, 4, 8, 3
    offsets = torch.tensor([0, 5, 5, 11], dtype=torch.int32)
    x, dy = torch.randn(S, n_in), torch.randn(S, n_out)
    want = grouped_weight_grad(x, dy, offsets, E, "loop")
    buf = torch.zeros(E, n_out, n_in).transpose(1, 2)  # an HF-style (E, O, I) parameter layout
    for r0 in range(0, S, 4):
        accumulate_grouped_weight_grad_(buf, x[r0:r0 + 4], dy[r0:r0 + 4], offsets.tolist(), r0)
    assert_close(buf, want, grad=True)
    assert buf.stride() == (n_out * n_in, 1, n_in)  # written in the buffer's own layout


def test_chunks_share_weight_grads_through_accumulate_grad() -> None:
    """c = 3: same grads as c = 1; .grad accumulates; one post-accumulate hook call per call."""
    moe = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=6, top_k=2,
                    skew_hot_experts=2, skew_bias=100.0)  # experts 2..5 get no rows
    grads = {}
    for c in (1, 3):
        torch.manual_seed(0)
        layer = MoELayer(moe, chunk=ChunkConfig(num_chunks=c, recompute="experts"))
        calls: list[str] = []
        for name, p in layer.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda _p, name=name, calls=calls: calls.append(name))
        x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # the second call adds into the existing .grad
            out, _aux = layer(x)
            out.square().sum().backward()
        grads[c] = {name: p.grad.clone() for name, p in layer.named_parameters()}
        assert sorted(calls) == sorted(2 * [n for n, _ in layer.named_parameters()])
    for name, want in grads[1].items():
        assert_close(grads[3][name], want, grad=True, msg=name)
    w_up_grad = next(g for name, g in grads[3].items() if name.endswith("w_up"))
    assert torch.equal(w_up_grad[2:], torch.zeros_like(w_up_grad[2:]))


def test_rejects_bad_block_sizes() -> None:
    x, idx, w, w_up, w_down = make_problem(4, 8, 4, 3, 2)
    one_row = (3 * 8 + 3 * 4 + 2 * 4) * 2  # (3·d + 3·n + G) elements at 2 bytes
    allowed = rf"must be None \(the device's default\) or an int in \[{one_row}, {2**63 - 1}\]"
    for bad_rows in (0, -1, 4.0, "4", True):
        with pytest.raises(ValueError, match=r"^block_rows must be None \(the device's default\) "
                           rf"or an int >= 1, got {bad_rows!r}$"):
            run_experts(x, w, build_routing_index(idx, 3), w_up, w_down,
                        block_rows=bad_rows)  # type: ignore[arg-type]
    for bad in (0, one_row - 1, 2**63, 4096.0, "4096", True):
        with pytest.raises(ValueError, match=rf"^MoEConfig.backward_block_bytes {allowed}"):
            MoEConfig(hidden_size=8, intermediate_size=4, num_experts=3, top_k=2,
                      backward_block_bytes=bad)  # type: ignore[arg-type]
    assert MoEConfig(hidden_size=8, intermediate_size=4, num_experts=3, top_k=2,
                     backward_block_bytes=one_row).backward_block_bytes == one_row


def test_split_up_projection_blocks_match_one_tensor() -> None:
    """(gate, up) halves streamed in 3-row blocks: the gradients of the concatenated weight."""
    T, d, n, E, k = 11, 8, 4, 3, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, sentinels=1)
    gate, up = (w_up[:, :, :n].detach().clone().requires_grad_(),
                w_up[:, :, n:].detach().clone().requires_grad_())
    index = build_routing_index(idx, E)
    grad_out = torch.randn(T, d)
    out = run_experts(x, w, index, w_up, w_down)
    want = torch.autograd.grad(out, (x, w_up), grad_out)
    out_split = run_experts(x, w, index, (gate, up), w_down,
                            block_rows=3)
    got = torch.autograd.grad(out_split, (x, gate, up), grad_out)
    assert_close(got[0], want[0], grad=True, msg="x")
    assert_close(torch.cat(got[1:], dim=2), want[1], grad=True, msg="w_up halves")


@pytest.mark.parametrize("rows", [1, 3, 7, 1000])
def test_dx_by_sort_matches_index_add_and_reference(monkeypatch: pytest.MonkeyPatch,
                                                      rows: int) -> None:
    """The deterministic dx (per-token gather through token_index_map, no atomics) that every
    non-CPU device takes: equal to the CPU's index_add_ sum and to the float64 reference, with
    sentinel slots, an empty expert and blocks that cut experts, under deterministic mode."""
    import memfine.experts.function as function_module

    T, d, n, E, k = 13, 8, 12, 5, 3
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, sentinels=4, empty_expert=True)
    index = build_routing_index(idx, E)
    grad_out = torch.randn(T, d)

    def grad_x() -> tuple[torch.Tensor, torch.Tensor]:
        out = run_experts(x, w, index, w_up, w_down, block_rows=rows)
        return out.detach(), torch.autograd.grad(out, x, grad_out)[0]

    out_index_add, by_index_add = grad_x()
    monkeypatch.setattr(function_module, "DEVICE_SUM_ON_CPU", True)
    with torch.autograd.set_grad_enabled(True):
        torch.use_deterministic_algorithms(True)
        try:
            (out_gather, by_sort), (out_again, again) = grad_x(), grad_x()
        finally:
            torch.use_deterministic_algorithms(False)
    assert torch.equal(by_sort, again) and torch.equal(out_gather, out_again)
    assert_close(by_sort, by_index_add, grad=True, msg="x")
    assert_close(out_gather, out_index_add, msg="out: the forward's per-token gather")
    ref = reference_experts(x.double(), idx, w.double(), w_up.double(), w_down.double())
    assert_close(out_gather, ref.detach().float(), msg="out vs reference")
    assert_close(by_sort, torch.autograd.grad(ref, x, grad_out.double())[0], grad=True,
                 msg="x vs reference")


def test_gradcheck_float64_dx_by_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    import memfine.experts.function as function_module

    monkeypatch.setattr(function_module, "DEVICE_SUM_ON_CPU", True)
    T, d, n, E, k = 5, 3, 2, 4, 2
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k, dtype=torch.float64,
                                           activation="swiglu", sentinels=1, empty_expert=True)
    index = build_routing_index(idx, E)

    def fn(x_: torch.Tensor) -> torch.Tensor:
        return run_experts(x_, w, index, w_up, w_down, backend="loop",
                           block_rows=3)

    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize(("d", "n", "E", "k"), [(32, 64, 4, 2), (32, 16, 16, 8)])
def test_streamed_forward_never_holds_a_gathered_copy(d: int, n: int, E: int, k: int) -> None:
    """With several row blocks the forward's peak stays below H + out + one (S, d) copy, which
    the one-block forward (gathered x next to H) reaches: no S·d gathered copy is ever live."""
    T = 96
    S = T * k
    x, idx, w, w_up, w_down = make_problem(T, d, n, E, k)
    index = build_routing_index(idx, E)

    def forward_peak(block_rows: int) -> int:
        with PeakMemoryTracker() as tracker:
            out = run_experts(x, w, index, w_up, w_down, block_rows=block_rows)
        del out
        return tracker.peak_bytes

    bound = (S * 2 * n + T * d + S * d) * 4  # H + out + one gathered copy
    assert forward_peak(8) < bound <= forward_peak(2**40)


def test_block_h_kept_when_the_graph_is_kept() -> None:
    """fp32, several blocks: a backward that does not keep the graph frees each block's saved H
    once its dH exists (tests/measure/test_profiled.py: the model frees it there too); one
    that keeps it (retain_graph) leaves H whole, so the graph runs again to the same values."""
    torch.manual_seed(0)
    T, d, n, E, k = 12, 8, 4, 3, 2
    x, idx_TK, weights, w_up, w_down = make_problem(T, d, n, E, k)
    index = build_routing_index(idx_TK, E)
    block_rows = 5  # 5 blocks of the 24 rows
    inputs = (x, weights, w_up, w_down)
    grad_out = torch.randn(T, d)
    out = run_experts(x, weights, index, w_up, w_down, block_rows=block_rows)
    first = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
    again = torch.autograd.grad(out, inputs, grad_out)
    fresh = torch.autograd.grad(
        run_experts(x, weights, index, w_up, w_down, block_rows=block_rows),
        inputs, grad_out)
    for a, b, c in zip(first, again, fresh, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_create_graph_is_one_clear_error() -> None:
    """The fused backward has no double backward: ``create_graph=True`` names the plain path."""
    x, idx_TK, weights, w_up, w_down = make_problem(8, 8, 4, 3, 2)
    out = run_experts(x, weights, build_routing_index(idx_TK, 3), w_up, w_down, block_rows=4)
    with pytest.raises(RuntimeError, match=r"no double backward: create_graph=True is not "
                                           r"supported; run_experts\(impl='plain', "
                                           r"backend='grouped_mm'\) is twice differentiable"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_plain_grouped_mm_experts_are_twice_differentiable() -> None:
    """What the fused error names works: d(Σ (dL/dx)²)/dw_up equals a per-token float64 loop's."""
    x, idx_TK, weights, w_up, w_down = make_problem(8, 8, 4, 3, 2)
    index = build_routing_index(idx_TK, 3)

    def second(impl_out: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
               *tensors: torch.Tensor) -> torch.Tensor:
        xs, ups, downs = (t.detach().requires_grad_() for t in tensors)
        grad_x, = torch.autograd.grad(impl_out(xs, ups, downs).square().sum(), xs,
                                      create_graph=True)
        return torch.autograd.grad(grad_x.square().sum(), ups)[0]

    got = second(lambda xs, ups, downs: run_experts(xs, weights, index, ups, downs,
                                                    impl="plain", backend="grouped_mm"),
                 x, w_up, w_down)
    want = second(lambda xs, ups, downs: reference_experts(xs, idx_TK, weights.detach().double(),
                                                           ups, downs),
                  x.double(), w_up.double(), w_down.double())
    assert_close(got, want, grad=True)
