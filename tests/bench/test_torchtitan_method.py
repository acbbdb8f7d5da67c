"""The ``torchtitan`` bench method: torchtitan's own RoutedExperts on memfine's weights and routing.

Reference: the float64 per-token loop (``memfine.reference.reference_experts``) on the same
weights and routing; torchtitan's GroupedExperts casts to bf16 for its GEMMs, so the comparison
uses the bf16 tolerance whatever the layer's dtype, after dividing both sides by the reference's
largest magnitude (the layer's init makes outputs small). Gradients reach memfine's parameters
through the weight views.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfine.baselines.layers import base_layer
from memfine.baselines.titan_style import torchtitan_missing
from memfine.bench.options import BenchOptions
from memfine.config import MoEConfig
from memfine.reference import reference_experts
from memfine.suites import experts
from tolerances import assert_close

pytestmark = pytest.mark.skipif(torchtitan_missing() is not None,
                                reason=f"torchtitan: {torchtitan_missing()}")
MOE = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=6, top_k=2, renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torchtitan_layer_matches_the_float64_reference(dtype: torch.dtype) -> None:
    from memfine.baselines.titan_style import torchtitan_layer

    base = base_layer(MOE, dtype=dtype, device=torch.device("cpu"), seed=0)
    layer = torchtitan_layer(base, MOE)
    x = torch.randn(40, MOE.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(1))
    out, aux = layer(x)
    assert out.dtype == dtype and aux.num_chunks == 1
    routing = base.router(x)
    w_up = base.experts.w_up.detach().double().requires_grad_(True)
    want = reference_experts(x.double(), routing.top_k_index,
                             routing.top_k_weights.detach().double(), w_up,
                             base.experts.w_down.detach().double())
    _assert_scaled_close(out, want, grad=False)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(g.to(dtype))
    want.backward(g.double())
    assert base.experts.w_up.grad is not None and base.experts.w_up.grad.dtype == dtype
    assert w_up.grad is not None
    _assert_scaled_close(base.experts.w_up.grad, w_up.grad, grad=True)


def _assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, *, grad: bool) -> None:
    scale = float(expected.detach().abs().max())
    assert scale > 0
    assert_close(actual.detach().double() / scale, expected.detach().double() / scale,
                 grad=grad, dtype=torch.bfloat16)


def test_experts_suite_runs_torchtitan_beside_grouped_mm() -> None:
    methods, _ = experts.build_methods(experts.QUICK, BenchOptions(dtype="bfloat16"),
                                       torch.device("cpu"), ("grouped_mm", "torchtitan"))
    outs = [m.forward()[0].detach().float() for m in methods]
    assert_close(outs[1], outs[0], dtype=torch.bfloat16)


def test_counts_suite_counts_torchtitan_s_three_grouped_gemms_without_a_host_sync() -> None:
    """torchtitan's GroupedExperts: w1, w3, w2 forward; dA and dB of each backward; no sync."""
    from memfine.suites import counts

    real = dataclasses.replace(counts.PRESETS["qwen3-30b-a3b"], tokens=256)
    (titan,) = counts.count_shape(real, ("torchtitan",))[2]
    assert titan.error is None
    full = titan.phase("full")
    assert full.ops["aten._grouped_mm.default"] == 3 + 6
    assert sum(full.syncs.values()) == 0
