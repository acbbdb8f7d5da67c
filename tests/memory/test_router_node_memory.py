"""The router node's memory model where the router dominates the layer's peak.

With d = n = 8 and E ≫ k the (T, E) router tensors outweigh the experts, so the peak lies in
the router node: its forward (selection sort, no graph) or its backward's recompute (the
losses' and the router's backward inside ``torch.autograd.grad``). Every router kind: saved
bytes, the peak and the forward's peak equal torch.profiler's to the byte (fp32).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_layer import ROUTERS, _layer_config, measure_layer

from memfine.config import MoEConfig
from memfine.memory.layer import moe_layer_memory, moe_layer_timeline

# (T, E, k, c): router-dominated layers, unchunked and chunked with recompute
SHAPES = [pytest.param(40, 32, 2, 1, id="T40-E32-k2"),
          pytest.param(64, 64, 4, 4, id="T64-E64-k4-chunked-c4")]


@pytest.mark.parametrize(("T", "E", "k", "c"), SHAPES)
@pytest.mark.parametrize("routing", ROUTERS)
def test_router_dominated_layers_are_exact_against_the_profiler(
        routing: dict[str, object], T: int, E: int, k: int, c: int) -> None:
    options = dict(routing)
    if "capacity_factor" in options:  # capacity = T: no pair is dropped
        options["capacity_factor"] = float(E)
    moe = dataclasses.replace(_layer_config(8, 8, E, k, skewed=False, impl="fused"),
                              **options)  # type: ignore[arg-type]
    recompute = "experts" if c > 1 else "none"
    measured = measure_layer(moe, T, torch.float32, c, recompute, peak="profiler")
    predicted = moe_layer_memory(moe, T, 4, num_chunks=c, recompute=recompute)
    assert (predicted.saved_bytes, predicted.peak_bytes, predicted.forward_peak_bytes) == (
        measured.saved_bytes, measured.peak_bytes, measured.forward_peak_bytes)
    live = moe_layer_timeline(moe, T, 4, num_chunks=c, recompute=recompute).peak_live
    assert any(v >= T * E * 4 and n.split(".")[0] in {"router", "lbl", "lbwd", "zbwd", "rbwd"}
               for n, v in live.items()), sorted(live.items(), key=lambda kv: -kv[1])[:4]


def test_the_fine_grained_layer_keeps_no_router_tensor_through_the_experts() -> None:
    """d 512, n 128, E 64, k 8, fp32, T 16384: no router or loss (T, E) tensor is alive at
    the layer's peak (the plain graph held the scores, the losses' softmax, logits and logit
    gradient through the experts' backward)."""
    moe = MoEConfig(hidden_size=512, intermediate_size=128, num_experts=64, top_k=8)
    T = 16384
    tl = moe_layer_timeline(moe, T, 4)
    assert not [n for n, v in tl.peak_live.items()
                if n.startswith(("router.", "lbl.", "z.", "zbwd.", "lbwd.")) and v >= T * 64 * 4]
