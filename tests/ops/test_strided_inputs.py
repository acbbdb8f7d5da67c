"""Strided inputs: transposed, sliced and expanded views give the contiguous result, exactly.

Every public entry point that takes routing or activations (the index builders, ``run_experts``,
``MoELayer``) reads a view by its values: the routing index is identical field by field, the
expert output and gradients equal the contiguous call bit for bit (same index, same GEMMs); the
layer's router reads a strided x through another fp32 GEMM path (fp32 tolerance).
Property tests (hypothesis) draw the routing, the view kind and the sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfine.config import MoEConfig
from memfine.dispatch import build_index_argsort, build_index_sort_free, build_routing_index
from memfine.experts import run_experts
from memfine.nn import MoELayer
from tolerances import assert_close

VIEWS = ("transposed", "sliced", "expanded", "stepped")


def strided_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A non-contiguous view with the values of the (T, k) or (T, d) tensor ``t``."""
    if kind == "transposed":  # stored (k, T), read as (T, k)
        return t.t().contiguous().t()
    if kind == "sliced":  # the first k columns of a wider tensor
        return torch.cat([t, torch.full_like(t, 7)], dim=1)[:, :t.shape[1]]
    if kind == "stepped":  # every other row of a taller tensor
        return torch.stack([t, torch.full_like(t, 7)], dim=1).reshape(-1, t.shape[1])[::2]
    assert kind == "expanded"  # one row for every token (stride 0 along T)
    return t[:1].expand(t.shape[0], -1)


def _routing(draw: st.DrawFn) -> tuple[torch.Tensor, int, str]:
    E = draw(st.integers(2, 7))
    k = draw(st.integers(1, E))
    T = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    sentinel = draw(st.booleans())
    if sentinel:
        idx[0, -1] = E
    return idx, E, draw(st.sampled_from(VIEWS))


routings = st.composite(_routing)


@settings(max_examples=40, deadline=None)
@given(routings())
def test_index_builders_read_views_by_value(case: tuple[torch.Tensor, int, str]) -> None:
    idx, E, kind = case
    view = strided_view(idx, kind)
    dense = view.contiguous()
    for build in (build_index_sort_free, build_index_argsort, build_routing_index):
        got, want = build(view, E), build(dense, E)
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b), (build.__name__, field.name)
            else:
                assert a == b, (build.__name__, field.name)


@settings(max_examples=20, deadline=None)
@given(routings(), st.sampled_from(("fused", "plain")))
def test_run_experts_reads_views_by_value(case: tuple[torch.Tensor, int, str], impl: str
                                          ) -> None:
    idx, E, kind = case
    T, k = idx.shape
    d, n = 8, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, d, generator=gen)
    w = torch.rand(T, k, generator=gen)
    w_up = torch.randn(E, d, 2 * n, generator=gen, requires_grad=True)
    w_down = torch.randn(E, n, d, generator=gen, requires_grad=True)

    def call(idx_: torch.Tensor, x_: torch.Tensor, w_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_ = x_.detach().requires_grad_()
        out = run_experts(x_, w_, build_routing_index(idx_, E), w_up, w_down, impl=impl)
        return (out, *torch.autograd.grad(out.square().sum(), (x_, w_up, w_down)))

    view = strided_view(idx, kind)
    want = call(view.contiguous(), x, w)
    got = call(view, strided_view(x, "transposed"), strided_view(w, "transposed"))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["transposed", "stepped"])
@pytest.mark.parametrize("experts_impl", ["fused", "plain"])
def test_moe_layer_reads_strided_hidden_states_by_value(kind: str, experts_impl: str) -> None:
    torch.manual_seed(0)
    moe = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                    experts_impl=experts_impl)  # type: ignore[arg-type]
    layer = MoELayer(moe)
    x = torch.randn(12, 8)

    def call(x_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_ = x_.detach().requires_grad_() if x_.is_leaf else x_
        leaf = x_ if x_.is_leaf else None
        out, aux = layer(x_)
        loss = out.square().sum() + aux.load_balancing_loss
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, [*params, *([leaf] if leaf is not None else [])])
        return (out, *grads)

    want = call(x)
    got = call(strided_view(x, kind))
    # the router's fp32 GEMM reads a strided x through another BLAS path: fp32 rounding only
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, grad=a is not got[0])
