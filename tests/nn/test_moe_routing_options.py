"""MoELayer routing options: replay under a user's checkpoint, jitter, shared experts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from memfine.config import ChunkConfig, MoEConfig
from memfine.nn import MoELayer
from memfine.reference import reference_experts, reference_moe
from memfine.routing import RoutingResult
from tolerances import assert_chunked_close, assert_close


def _tied_layer() -> MoELayer:
    """d = E = 4, router weight I: the logits are the input, so equal inputs tie every expert."""
    layer = MoELayer(MoEConfig(hidden_size=4, intermediate_size=8, num_experts=4,
                               top_k=2)).double()
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4, dtype=torch.float64))
    return layer


def _grads(layer: MoELayer, wrap: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.ones(6, 4, dtype=torch.float64, requires_grad=True)  # all logits tied
    calls = []

    def block(x_in: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        bump = torch.zeros(4, dtype=torch.float64)
        bump[3] = 1e-7 * (len(calls) - 1)  # the recompute sees expert 3 ahead by 1e-7
        return layer(x_in + bump)[0]

    layer.zero_grad(set_to_none=True)
    out = block(x) if wrap == "none" else checkpoint(block, x, use_reentrant=False)
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    return x.grad, [p.grad for p in layer.parameters()]  # type: ignore[return-value]


def test_checkpointed_layer_replays_the_forward_routing() -> None:
    layer = _tied_layer()
    x_plain, plain = _grads(layer, "none")
    x_ckpt, ckpt = _grads(layer, "checkpoint")
    w_up = dict(zip([n for n, _ in layer.named_parameters()], ckpt, strict=True))["experts.w_up"]
    assert torch.equal(w_up[2:], torch.zeros_like(w_up[2:]))  # ties → experts 0 and 1 only
    assert_close(x_ckpt, x_plain, grad=True)
    for a, b in zip(ckpt, plain, strict=True):
        assert_close(a, b, grad=True)
    assert not layer.router.replay._records  # consumed: nothing left behind


def test_reentrant_checkpoint_raises_instead_of_rerouting() -> None:
    layer = _tied_layer()
    x = torch.ones(6, 4, dtype=torch.float64, requires_grad=True)
    out = checkpoint(lambda v: layer(v)[0], x, use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"routing cannot be replayed; use torch\.utils\."
                                           r"checkpoint\(\.\.\., use_reentrant=False\)"):
        out.sum().backward()


def test_records_die_with_their_graph() -> None:
    layer = _tied_layer()
    for _ in range(3):
        out, _ = layer(torch.randn(5, 4, dtype=torch.float64, requires_grad=True))
        out.sum().backward()
        del out
    assert all(r() is None for r in layer.router.replay._records)
    layer(torch.randn(5, 4, dtype=torch.float64, requires_grad=True))  # output dropped at once
    assert all(r() is None for r in layer.router.replay._records)


def test_jitter_only_in_training_and_only_on_the_router_input() -> None:
    config = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                       router_jitter_eps=0.3)
    layer = MoELayer(config).double()
    plain = MoELayer(MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4,
                               top_k=2)).double()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(16, 8, dtype=torch.float64)
    layer.eval()
    assert torch.equal(layer(x)[0], plain(x)[0])  # eval: no jitter
    layer.train()
    seen: list[RoutingResult] = []
    layer.router.register_forward_hook(lambda m, args, result: seen.append(result))
    out, _ = layer(x)
    routing = seen[-1]
    clean_logits = x @ layer.router.weight.t()
    assert not torch.allclose(routing.logits, clean_logits)  # the router saw a jittered input
    ratio = routing.logits / clean_logits  # not a fixed per-token factor: per-element jitter
    assert float(ratio.detach().std()) > 0
    expected = reference_experts(x, routing.top_k_index, routing.top_k_weights,
                                 layer.experts.w_up, layer.experts.w_down)
    assert_close(out, expected)  # the experts got the unjittered x


def _shared_layer(gate: bool, **chunk: object) -> MoELayer:
    config = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                       num_shared_experts=2, shared_intermediate_size=12,
                       shared_expert_gate=gate, routed_scaling_factor=2.5, n_group=2,
                       topk_group=1)
    layer = MoELayer(config, chunk=ChunkConfig(**chunk) if chunk else None)  # type: ignore[arg-type]
    with torch.no_grad():
        layer.router.weight.normal_()
    return layer


@pytest.mark.parametrize("gate", [False, True], ids=["no_gate", "sigmoid_gate"])
def test_shared_experts_match_the_reference(gate: bool) -> None:
    layer = _shared_layer(gate).double()
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x)
    shared = layer.shared_experts
    assert shared is not None
    xr = x.detach().clone().requires_grad_(True)
    ref, _, _ = reference_moe(
        xr, layer.router.weight, layer.experts.w_up, layer.experts.w_down, 2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5,
        shared=(shared.experts.w_up, shared.experts.w_down, shared.gate))
    assert_close(out, ref)
    probe = torch.randn_like(out)
    params = list(layer.parameters())
    got = torch.autograd.grad((out * probe).sum(), [x, *params])
    want = torch.autograd.grad((ref * probe).sum(), [xr, *params])
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, grad=True)


def test_shared_experts_chunked_equal_unchunked() -> None:
    x = torch.randn(2, 9, 8)
    one = _shared_layer(True)
    outs = []
    for layer in (one, _shared_layer(True, num_chunks=3, recompute="experts")):
        layer.load_state_dict(one.state_dict())
        xr = x.clone().requires_grad_(True)
        out, _ = layer(xr)
        out.square().sum().backward()
        outs.append([out, xr.grad, *(p.grad for p in layer.parameters())])
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        assert_chunked_close(a, b, name=str(i))


def test_shared_experts_skip_padding() -> None:
    layer = _shared_layer(False)
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    out, _ = layer(x, mask)
    assert torch.equal(out[1, 3:], torch.zeros(2, 8))


@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_every_option_together_matches_the_reference(impl: str, num_chunks: int,
                                                     score_func: str) -> None:
    config = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=8, top_k=3,
                       score_func=score_func, experts_impl=impl, capacity_factor=0.75,
                       min_capacity=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    layer = MoELayer(config, chunk=ChunkConfig(num_chunks=num_chunks,
                                               recompute="experts")).double()
    with torch.no_grad():
        layer.router.weight.normal_()
        layer.router.selection_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    out, aux = layer(x)
    xr = x.detach().clone().requires_grad_(True)
    ref, idx, _ = reference_moe(
        xr, layer.router.weight, layer.experts.w_up, layer.experts.w_down, 3,
        score_func=score_func, selection_bias=layer.router.selection_bias, capacity_factor=0.75,
        min_capacity=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert torch.equal(aux.tokens_per_expert, torch.bincount(idx[idx < 8], minlength=8))
    assert int(aux.dropped_pairs) == int((idx == 8).sum()) > 0
    assert_close(out, ref)
    params = list(layer.parameters())
    got = torch.autograd.grad(out.square().sum(), [x, *params])
    want = torch.autograd.grad(ref.square().sum(), [xr, *params])
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, grad=True)
