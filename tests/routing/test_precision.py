"""Mixed precision: fp32 router under autocast, fp32 router buffers through .to(dtype), experts
following autocast, fixed-shape expert counts (docs/compile.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfine.config import MoEConfig
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.measure import SavedTensorsTracker
from memfine.nn import MoELayer
from memfine.routing import TopKRouter
from memfine.routing.precision import count_per_expert
from tolerances import assert_close

BF16 = torch.bfloat16


def _near_tie_router(T: int = 256, d: int = 8) -> tuple[TopKRouter, torch.Tensor]:
    """Two experts whose logits differ by about 1e-3 for every token."""
    router = TopKRouter(d, 2, 1, renormalize=False)
    x_TD = torch.randn(T, d)
    with torch.no_grad():
        router.weight[0] = torch.randn(d)
        router.weight[1] = router.weight[0] + 1e-3 * torch.randn(d)
    return router, x_TD


def test_router_is_fp32_inside_autocast() -> None:
    router, x_TD = _near_tie_router()
    want = router(x_TD)
    with torch.autocast("cpu", dtype=BF16):
        got = router(x_TD)
    assert got.logits.dtype == torch.float32
    assert torch.equal(got.logits, want.logits) and torch.equal(got.top_k_index, want.top_k_index)
    # What a bf16 router linear would do: logits 1e-3 apart round together and choices flip.
    with torch.autocast("cpu", dtype=BF16):
        bf16_logits = F.linear(x_TD, router.weight)
    assert bf16_logits.dtype == BF16
    flipped = (bf16_logits.float().argmax(-1) != want.top_k_index[:, 0]).float().mean()
    assert flipped > 0.05


def test_losses_are_fp32_inside_autocast() -> None:
    layer = MoELayer(MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2))
    x = torch.randn(32, 16)
    _, want = layer(x)
    with torch.autocast("cpu", dtype=BF16):
        out, got = layer(x)
    assert out.dtype == BF16  # the experts follow autocast
    assert got.load_balancing_loss.dtype == got.z_loss.dtype == torch.float32
    assert torch.equal(got.load_balancing_loss, want.load_balancing_loss)
    assert torch.equal(got.z_loss, want.z_loss)


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).float()


@pytest.mark.parametrize("cast", ["to", "bfloat16", "half"])
def test_selection_bias_stays_fp32_through_dtype_casts(cast: str) -> None:
    """A realistic bias (offset ≈ 6.8, spread ≈ 0.2): bf16 keeps 8 of its 16 values."""
    E = 16
    layer = MoELayer(MoEConfig(hidden_size=16, intermediate_size=16, num_experts=E, top_k=2))
    bias_E = torch.linspace(6.7, 6.9, E)
    assert _bf16_exact(bias_E).unique().numel() == 8  # the collapse a cast would cause
    with torch.no_grad():
        layer.router.selection_bias.copy_(bias_E)
        layer.router.weight.copy_(_bf16_exact(layer.router.weight))  # same logits in both runs
    x = _bf16_exact(torch.randn(512, 16))
    want = layer.router(x).top_k_index
    dtype = torch.float16 if cast == "half" else BF16
    moved = {"to": lambda m: m.to(BF16), "bfloat16": lambda m: m.bfloat16(),
             "half": lambda m: m.half()}[cast](layer)
    bias = moved.router.selection_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, bias_E)
    assert moved.router.weight.dtype == dtype
    if cast != "half":  # bf16 holds the fp32 router weight and x exactly: same scores
        assert torch.equal(moved.router(x.to(dtype)).top_k_index, want)
        rounded = layer.router.selection_bias.to(BF16).float()
        with torch.no_grad():
            moved.router.selection_bias.copy_(rounded)
        changed = (moved.router(x.to(dtype)).top_k_index != want).any(-1).float().mean()
        assert changed > 0.05  # with a bf16-rounded bias tokens do change experts


def test_selection_bias_follows_double() -> None:
    router = TopKRouter(8, 4, 2)
    with torch.no_grad():
        router.selection_bias.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    router = router.double()
    assert router.selection_bias.dtype == torch.float64
    assert torch.equal(router.selection_bias, torch.tensor([0.1, 0.2, 0.3, 0.4]).double())


def test_experts_follow_autocast_and_save_half_the_bytes() -> None:
    """Inside autocast the experts compute in bf16 and save bf16 x, H and weights (half the
    fp32 bytes); the int32 index arrays are unchanged; the extra saved storages are exactly the
    bf16 copies of the two weights; master weights stay fp32 with fp32 gradients."""
    T, D, N, E, K = 24, 16, 32, 4, 2
    w_up = (torch.randn(E, D, 2 * N) / D ** 0.5).requires_grad_(True)  # unit-scale H and out
    w_down = (torch.randn(E, N, D) / N ** 0.5).requires_grad_(True)
    x = torch.randn(T, D, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    index = build_routing_index(top_k_index, E)

    def saved(autocast: bool) -> tuple[SavedTensorsTracker, torch.Tensor]:
        with torch.autocast("cpu", dtype=BF16, enabled=autocast), \
                SavedTensorsTracker(exclude=[w_up, w_down]) as tracker:
            out = run_experts(x, weights, index, w_up, w_down)
        return tracker, out

    fp32, out32 = saved(False)
    bf16, out16 = saved(True)
    assert out16.dtype == BF16
    assert_close(out16.float(), out32, dtype=BF16)

    def float_bytes(t: SavedTensorsTracker, *, weight_copies: bool) -> int:
        is_weight = {(E, D, 2 * N), (E, N, D)}
        return sum(i.nbytes for i in t.items if i.dtype.is_floating_point
                   and (i.shape in is_weight) == weight_copies)

    assert float_bytes(bf16, weight_copies=False) * 2 == float_bytes(fp32, weight_copies=False)
    assert float_bytes(bf16, weight_copies=True) == (w_up.numel() + w_down.numel()) * 2
    assert float_bytes(fp32, weight_copies=True) == 0
    int_bytes = [sum(i.nbytes for i in t.items if not i.dtype.is_floating_point)
                 for t in (fp32, bf16)]
    assert int_bytes[0] == int_bytes[1] > 0
    shapes = {i.shape: i.dtype for i in bf16.items}
    assert shapes[(T, D)] == BF16 and shapes[(T * K, 2 * N)] == BF16  # x and H
    out16.float().sum().backward()
    assert w_up.dtype == w_up.grad.dtype == torch.float32
    assert w_down.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_count_per_expert_ignores_sentinels(dtype: torch.dtype) -> None:
    ids = torch.tensor([[0, 3], [3, 5], [-1, 2], [4, 0]], dtype=dtype)  # E = 4: 5, -1, 4 ignored
    assert count_per_expert(ids, 4).tolist() == [2, 0, 1, 2]
    assert count_per_expert(ids[:0], 4).tolist() == [0, 0, 0, 0]
