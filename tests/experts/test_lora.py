"""Split LoRA in the fused experts against the per-token reference with explicit W + s·B·A.

Float64 values and every gradient (x, routing weights, adapters, base weights when trainable),
gradcheck with and without dropout, frozen base weights get no gradient, unused experts' adapters
get exact zeros, and the saved set is x, H, the routing weights, int32 indices and U (S·r) per
adapter.
"""

from __future__ import annotations

import pytest
import torch

from memfine.dispatch import build_routing_index
from memfine.experts.lora_experts import run_lora_experts
from memfine.lora.adapters import ExpertLoRA
from memfine.measure.saved import track_saved_tensors
from memfine.reference import reference_experts
from tolerances import assert_close

T, D, N, E, K, R = 9, 6, 5, 4, 2, 3
ONE_ROW = 1  # the smallest block: one row


def _adapters(dtype: torch.dtype, G: int, targets: str = "both", r: int = R
              ) -> dict[str, torch.Tensor | None]:
    def leaf(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, dtype=torch.float64) / shape[-1] ** 0.5).to(
            dtype).requires_grad_()
    up = targets in ("both", "up")
    down = targets in ("both", "down")
    return {"a_up_ERD": leaf(E, r, D) if up else None, "b_up_EGR": leaf(E, G, r) if up else None,
            "a_down_ERN": leaf(E, r, N) if down else None,
            "b_down_EDR": leaf(E, D, r) if down else None}


def _problem(dtype: torch.dtype = torch.float64, *, empty_expert: bool = False,
             targets: str = "both", base_grad: bool = True, bias: bool = False):
    pool = E - 1 if empty_expert else E
    idx = torch.stack([torch.randperm(pool)[:K] for _ in range(T)])
    idx[-1, -1] = E  # one sentinel slot: contributes zero
    x = torch.randn(T, D, dtype=dtype).requires_grad_()
    w = torch.rand(T, K, dtype=dtype).requires_grad_()
    w_up = (torch.randn(E, D, 2 * N, dtype=dtype) / D ** 0.5).requires_grad_(base_grad)
    w_down = (torch.randn(E, N, D, dtype=dtype) / N ** 0.5).requires_grad_(base_grad)
    biases = {}
    if bias:
        biases = {"b_up_EG": torch.randn(E, 2 * N, dtype=dtype).requires_grad_(),
                  "b_down_ED": torch.randn(E, D, dtype=dtype).requires_grad_()}
    return x, idx, w, w_up, w_down, _adapters(dtype, 2 * N, targets), biases


def _merged(w_up, w_down, ad, scale):
    """W + s·(B·A)ᵀ in memfine's (in, out) layout: the explicit dense update."""
    up, down = w_up, w_down
    if ad["a_up_ERD"] is not None:
        up = w_up + scale * torch.einsum("erd,egr->edg", ad["a_up_ERD"], ad["b_up_EGR"])
    if ad["a_down_ERN"] is not None:
        down = w_down + scale * torch.einsum("ern,edr->end", ad["a_down_ERN"], ad["b_down_EDR"])
    return up, down


def _leaves(x, w, w_up, w_down, ad, biases):
    tensors = [x, w, w_up, w_down, *(t for t in ad.values() if t is not None), *biases.values()]
    return [t for t in tensors if t.requires_grad]


@pytest.mark.parametrize("targets", ["both", "up", "down"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("block_rows", [2**30, ONE_ROW], ids=["one_block", "row_blocks"])
def test_matches_reference_float64(targets: str, bias: bool, block_rows: int) -> None:
    x, idx, w, w_up, w_down, ad, biases = _problem(targets=targets, bias=bias)
    scale = 2.0 / R
    lora = ExpertLoRA(**ad, scale=scale)
    out = run_lora_experts(x, w, build_routing_index(idx, E), w_up, w_down, lora,
                           backend="loop", block_rows=block_rows, **biases)
    up, down = _merged(w_up, w_down, ad, scale)
    ref = reference_experts(x, idx, w, up, down, **biases)
    assert_close(out, ref)
    grad_out = torch.randn_like(out)
    leaves = _leaves(x, w, w_up, w_down, ad, biases)
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(ref, leaves, grad_out)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, grad=True)


def test_gradcheck_float64_with_dropout() -> None:
    x, idx, w, w_up, w_down, ad, _ = _problem()
    index = build_routing_index(idx, E)
    names = [n for n, t in ad.items() if t is not None]

    def fn(x_, w_, *adapters):
        lora = ExpertLoRA(**dict(zip(names, adapters, strict=True)), scale=0.7, dropout=0.4)
        return run_lora_experts(x_, w_, index, w_up, w_down, lora, backend="loop", seed=11,
                                block_rows=ONE_ROW)

    assert torch.autograd.gradcheck(fn, (x, w, *(ad[n] for n in names)))


def test_dropout_masks_depend_on_seed_only() -> None:
    x, idx, w, w_up, w_down, ad, _ = _problem()
    index = build_routing_index(idx, E)
    lora = ExpertLoRA(**ad, scale=1.0, dropout=0.5)
    a = run_lora_experts(x, w, index, w_up, w_down, lora, backend="loop", seed=3)
    b = run_lora_experts(x, w, index, w_up, w_down, lora, backend="loop", seed=3,
                         block_rows=ONE_ROW)
    c = run_lora_experts(x, w, index, w_up, w_down, lora, backend="loop", seed=4)
    no_drop = run_lora_experts(x, w, index, w_up, w_down, ExpertLoRA(**ad, scale=1.0),
                               backend="loop")
    assert_close(b, a)  # the masks do not depend on the backward's row blocks
    assert not torch.allclose(a, c)
    assert not torch.allclose(a, no_drop)


def test_frozen_base_gets_no_gradient_and_unused_experts_get_zeros() -> None:
    x, idx, w, w_up, w_down, ad, _ = _problem(torch.float32, base_grad=False)
    lora = ExpertLoRA(**ad, scale=1.0)
    # a first pass in which every expert has rows (stale buffers would show up below)
    run_lora_experts(x, w, build_routing_index(idx, E), w_up, w_down, lora).sum().backward()
    for t in ad.values():
        t.grad = None
    idx_empty = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)])
    out = run_lora_experts(x, w, build_routing_index(idx_empty, E), w_up, w_down, lora)
    out.square().sum().backward()
    assert w_up.grad is None and w_down.grad is None
    for name, t in ad.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert torch.equal(t.grad[E - 1], torch.zeros_like(t.grad[E - 1])), name
        assert t.grad[: E - 1].abs().sum() > 0, name


def test_saves_x_h_and_rank_r_intermediates_only() -> None:
    x, idx, w, w_up, w_down, ad, _ = _problem(torch.float32, base_grad=False)
    index = build_routing_index(idx, E)
    lora = ExpertLoRA(**ad, scale=1.0)
    with track_saved_tensors(exclude=[w_up, w_down, *lora.tensors()]) as saved:
        run_lora_experts(x, w, index, w_up, w_down, lora)
    S = index.num_rows
    floats = sorted(item.shape for item in saved.items if item.dtype.is_floating_point)
    assert floats == sorted([(T, D), (S, 2 * N), (T, K), (S, R), (S, R)])
    floats = (T * D + S * 2 * N + T * K + 2 * S * R) * 4
    ints = 4 * (2 * S + T * K + E + 1)
    assert saved.total_bytes == floats + ints


@pytest.mark.parametrize(("field", "kwargs", "message"), [
    ("rank", {"r": 7}, r"LoRA rank of w_up must be in \[1, min\(d_in, d_out\)=6\]"),
    ("dtype", {"dtype": torch.float32}, r"ExpertLoRA.a_up dtype must match"),
])
def test_bad_adapters_raise(field: str, kwargs: dict, message: str) -> None:
    x, idx, w, w_up, w_down, _, _ = _problem()
    ad = _adapters(kwargs.get("dtype", torch.float64), 2 * N, "up", kwargs.get("r", R))
    with pytest.raises(ValueError, match=message):
        run_lora_experts(x, w, build_routing_index(idx, E), w_up, w_down,
                         ExpertLoRA(**ad, scale=1.0))
