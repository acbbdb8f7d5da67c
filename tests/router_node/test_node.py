"""The router node (router + aux losses in one autograd node, logits recomputed in backward).

Against the plain autograd graph of the same layer (bit for bit: the same kernels run on the
same values, only the graph's lifetime differs) and against a float64 reference of the routing
(:func:`memfine.reference.reference_route`) for the gradients of x and the router weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import memfine.nn.moe as moe_module
from memfine.config import ChunkConfig, MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.nn import MoELayer
from memfine.reference import reference_route
from memfine.router_node import RouterNode, node_applies, route_with_losses
from memfine.routing import TopKRouter, load_balancing_loss, sequence_balance_loss, z_loss
from tolerances import assert_close

D, E, K = 8, 8, 2
BASE = MoEConfig(hidden_size=D, intermediate_size=8, num_experts=E, top_k=K)

# (MoEConfig overrides, dtype, chunks, padding, LoRA router trained): every routing option
LAYERS = [
    pytest.param({}, torch.float32, 1, False, None, id="softmax"),
    pytest.param({"renormalize": False}, torch.float32, 1, False, None, id="softmax-no-renorm"),
    pytest.param({"score_func": "sigmoid"}, torch.float32, 2, False, None, id="sigmoid-c2"),
    pytest.param({"score_func": "sigmoid", "renormalize": False}, torch.float32, 1, False, None,
                 id="sigmoid-no-renorm"),
    pytest.param({"score_func": "sqrtsoftplus"}, torch.float32, 4, False, None,
                 id="sqrtsoftplus-c4"),
    pytest.param({"score_func": "sqrtsoftplus", "renormalize": False,
                  "routed_scaling_factor": 2.5}, torch.float32, 1, False, None,
                 id="sqrtsoftplus-no-renorm-scaled"),
    pytest.param({"score_func": "sigmoid", "n_group": 4, "topk_group": 2}, torch.float32, 1,
                 False, None, id="groups"),
    pytest.param({"capacity_factor": 0.5}, torch.float32, 1, False, None, id="capacity-drops"),
    pytest.param({"capacity_factor": 0.5, "drop_policy": "position"}, torch.float32, 2, True,
                 None, id="capacity-position-padding-c2"),
    pytest.param({"skew_hot_experts": 2, "skew_bias": 0.3}, torch.float32, 1, True, None,
                 id="selection-bias-padding"),
    pytest.param({"seq_aux_loss_coef": 0.01}, torch.float32, 1, True, None, id="sequence-loss"),
    pytest.param({}, torch.float32, 1, False, False, id="lora-frozen-router"),
    pytest.param({"score_func": "sigmoid"}, torch.float32, 2, False, True,
                 id="lora-trained-router-c2"),
    pytest.param({}, torch.bfloat16, 1, False, None, id="bf16"),
    pytest.param({"score_func": "sigmoid", "capacity_factor": 0.5}, torch.bfloat16, 4, True,
                 None, id="bf16-capacity-padding-c4"),
]


def _layer(overrides: dict[str, object], dtype: torch.dtype, chunks: int,
           train_router: bool | None) -> MoELayer:
    torch.manual_seed(0)
    lora = None if train_router is None else LoRAConfig(rank=2, train_router=train_router)
    chunk = ChunkConfig(num_chunks=chunks, recompute="experts" if chunks > 1 else "none")
    layer = MoELayer(dataclasses.replace(BASE, **overrides),  # type: ignore[arg-type]
                     chunk=chunk, lora=lora).to(dtype)
    with torch.no_grad():  # unit-scale logits: routing that depends on every option
        layer.router.weight.normal_()
    return layer


def _run(layer: MoELayer, node: bool, padding: bool, wrap: bool = False
         ) -> list[torch.Tensor | None]:
    """Output, losses and the gradients of x and every parameter, with or without the node."""
    dtype = layer.router.weight.dtype
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, D, generator=gen).to(dtype).requires_grad_(True)
    mask = None
    if padding:
        mask = torch.ones(2, 12, dtype=torch.bool)
        mask[1, 9:] = False
    grad_out = torch.randn(2, 12, D, generator=gen).to(dtype)
    layer.zero_grad(set_to_none=True)
    applies = moe_module.node_applies
    # patched through backward too: a checkpoint's recompute runs the layer there
    moe_module.node_applies = applies if node else (lambda router: False)  # type: ignore[assignment]
    try:
        out, aux = (checkpoint(layer, x, mask, use_reentrant=False) if wrap
                    else layer(x, mask))
        losses = [aux.load_balancing_loss, aux.z_loss]
        if aux.sequence_balance_loss is not None:
            losses.append(aux.sequence_balance_loss)
        total = (out.float() * grad_out.float()).sum() + sum(
            c * v for c, v in zip((0.1, 0.01, 1.0), losses, strict=False))
        total.backward()
    finally:
        moe_module.node_applies = applies  # type: ignore[assignment]
    return [out.detach(), *(v.detach() for v in losses), aux.tokens_per_expert, x.grad,
            *(p.grad for p in layer.parameters())]


def _assert_identical(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), i
        assert a is None or b is None or torch.equal(a, b), (i, (a - b).abs().max())


@pytest.mark.parametrize(("overrides", "dtype", "chunks", "padding", "train_router"), LAYERS)
def test_node_equals_the_plain_graph_bit_for_bit(overrides: dict[str, object],
                                                 dtype: torch.dtype, chunks: int,
                                                 padding: bool, train_router: bool | None
                                                 ) -> None:
    layer = _layer(overrides, dtype, chunks, train_router)
    assert node_applies(layer.router)
    got, want = _run(layer, True, padding), _run(layer, False, padding)
    _assert_identical(got, want)
    if train_router is False:  # a frozen router: no weight gradient from the node
        assert layer.router.weight.grad is None


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_node_under_a_users_checkpoint_replays_and_matches(score_func: str) -> None:
    """The whole layer in a non-reentrant checkpoint: the recompute's node replays the
    forward's selection; outputs and gradients equal the plain graph's under the same wrap."""
    layer = _layer({"score_func": score_func, "capacity_factor": 0.5}, torch.float32, 2, None)
    got, want = _run(layer, True, True, wrap=True), _run(layer, False, True, wrap=True)
    _assert_identical(got, want)
    _assert_identical(got, _run(layer, True, True))  # and the unwrapped layer's


def test_node_applies_only_to_eager_training_forwards() -> None:
    router = TopKRouter(D, E, K, jitter_eps=0.1)
    assert not node_applies(router)  # training with input jitter: the plain graph
    router.eval()
    assert node_applies(router)
    with torch.no_grad():
        assert not node_applies(router)


# router options as reference_route takes them, plus the layer's own
REFERENCE = [
    pytest.param("softmax", True, {}, id="softmax"),
    pytest.param("softmax", False, {"routed_scaling_factor": 2.5}, id="softmax-scaled"),
    pytest.param("sigmoid", True, {"n_group": 4, "topk_group": 2}, id="sigmoid-groups"),
    pytest.param("sigmoid", False, {}, id="sigmoid-no-renorm"),
    pytest.param("sqrtsoftplus", True, {"capacity_factor": 0.5}, id="sqrtsoftplus-capacity"),
    pytest.param("sqrtsoftplus", False, {"capacity_factor": 0.5, "drop_policy": "position"},
                 id="sqrtsoftplus-capacity-position"),
]


def _reference_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     score_func: str, renormalize: bool, options: dict[str, object],
                     grad_w: torch.Tensor) -> Iterator[torch.Tensor]:
    """float64 grads of x and W_r of Σ weights·g + LBL + z + the sequence loss."""
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, weight))
    kw = {"selection_bias": bias, **options}
    _, weights, logits = reference_route(x64, w64, K, score_func, renormalize,
                                             **kw)  # type: ignore[arg-type]
    no_cap = {k: v for k, v in kw.items() if k not in ("capacity_factor", "drop_policy")}
    selected, _, _ = reference_route(x64, w64, K, score_func, renormalize,
                                     **no_cap)  # type: ignore[arg-type]
    scores = {"softmax": logits.softmax(-1), "sigmoid": torch.sigmoid(logits),
              "sqrtsoftplus": torch.nn.functional.softplus(logits).sqrt()}[score_func]
    total = ((weights * grad_w.double()).sum() + load_balancing_loss(logits, selected)
             + z_loss(logits) + sequence_balance_loss(scores, selected, 6))
    yield from torch.autograd.grad(total, (x64, w64))


@pytest.mark.parametrize(("score_func", "renormalize", "options"), REFERENCE)
def test_node_gradients_match_a_float64_reference(score_func: str, renormalize: bool,
                                                  options: dict[str, object]) -> None:
    torch.manual_seed(0)
    router = TopKRouter(D, E, K, score_func=score_func,  # type: ignore[arg-type]
                        renormalize=renormalize,
                        options=dataclasses.replace(BASE, score_func=score_func,
                                                    renormalize=renormalize, **options))
    with torch.no_grad():
        router.weight.normal_()
        router.selection_bias.copy_(torch.linspace(-0.2, 0.2, E))
    x = torch.randn(12, D, requires_grad=True)
    grad_w = torch.randn(12, K)
    routing, losses = route_with_losses(router, x, None, 6, lambda stats: stats)
    assert routing.top_k_weights.grad_fn is not None
    assert type(routing.top_k_weights.grad_fn).__name__ == f"{RouterNode.__name__}Backward"
    assert not routing.logits.requires_grad and not routing.scores.requires_grad
    assert losses.sequence is not None
    ((routing.top_k_weights * grad_w).sum() + losses.load_balancing + losses.z
     + losses.sequence).backward()
    want_x, want_w = _reference_grads(x, router.weight, router.selection_bias, score_func,
                                      renormalize, options, grad_w)
    assert x.grad is not None and router.weight.grad is not None
    assert_close(x.grad, want_x, grad=True, dtype=torch.float32, msg="x")
    assert_close(router.weight.grad, want_w, grad=True, dtype=torch.float32, msg="W_r")


def test_unused_loss_gradients_and_a_weights_only_backward() -> None:
    """Gradients reach the node for some outputs only (None for the rest): the others count as
    zero, as in the plain graph; no gradient at all leaves the inputs untouched."""
    torch.manual_seed(0)
    router = TopKRouter(D, E, K)
    x = torch.randn(12, D, requires_grad=True)
    routing, losses = route_with_losses(router, x, None, None, lambda stats: stats)
    assert losses.sequence is None
    routing.top_k_weights.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    router.zero_grad(set_to_none=True)
    plain = router(x_ref)
    plain.top_k_weights.sum().backward()
    assert x.grad is not None and x_ref.grad is not None
    assert torch.equal(x.grad, x_ref.grad)
