"""The arithmetic lower bound the commands check before building anything."""

from __future__ import annotations

import pytest

from memfine.config import MoEConfig
from memfine.memory.bounds import weights_and_inputs_lower_bound
from memfine.nn import MoELayer

SIZES = dict(num_layers=2, num_experts=4, hidden_size=8, intermediate_size=3, tokens=5,
             dtype_bytes=2)


def test_bound_by_hand() -> None:
    # gated: per layer w_up 4·8·6 = 192 and w_down 4·3·8 = 96 elements; X 5·8 = 40
    assert weights_and_inputs_lower_bound(**SIZES) == (2 * (192 + 96) + 2 * 40) * 2 == 1312
    # non-gated: w_up 4·8·3 = 96
    assert weights_and_inputs_lower_bound(**SIZES, gated=False) == (2 * (96 + 96) + 80) * 2
    # weights over 5 ranks: ceil(576 / 5) = 116 elements each; the inputs are this rank's own
    assert weights_and_inputs_lower_bound(**SIZES, shards=5) == (116 + 80) * 2 == 392


def test_bound_is_exact_for_unbounded_sizes() -> None:
    huge = weights_and_inputs_lower_bound(num_layers=10**6, num_experts=2**63 - 1,
                                          hidden_size=10**6, intermediate_size=1, tokens=1,
                                          dtype_bytes=4)
    assert huge == (10**6 * (2**63 - 1) * 10**6 * 3 + 10**6 * 10**6) * 4


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_bound_counts_the_built_experts_weights(activation: str) -> None:
    moe = MoEConfig(hidden_size=8, intermediate_size=3, num_experts=4, top_k=2,
                    activation=activation)
    layer = MoELayer(moe)
    weights = layer.experts.w_up.numel() + layer.experts.w_down.numel()
    got = weights_and_inputs_lower_bound(num_layers=1, num_experts=4, hidden_size=8,
                                         intermediate_size=3, tokens=5, dtype_bytes=4,
                                         gated=moe.gated)
    assert got == (weights + 5 * 8) * 4
