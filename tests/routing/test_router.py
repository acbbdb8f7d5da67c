"""TopKRouter and route(): values vs memfine.reference.reference_route, fp32, bias, mask."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from memfine.config import MoEConfig
from memfine.nn import MoELayer
from memfine.reference import REFERENCE_SCORES, reference_route
from memfine.routing import RouteOptions, TopKRouter, route
from memfine.routing.losses import load_balancing_loss, z_loss
from memfine.routing.scores import SCORE_FUNCTIONS
from tolerances import assert_close

T, D, E = 12, 6, 5


def _router(top_k: int, dtype: torch.dtype, **kwargs: object) -> TopKRouter:
    router = TopKRouter(D, E, top_k, **kwargs).to(dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        router.weight.normal_()  # unit-scale logits: no near-ties between experts
    return router


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("score_func", sorted(SCORE_FUNCTIONS))
@pytest.mark.parametrize("top_k", [1, 2, E])
def test_router_matches_reference(top_k: int, score_func: str, renormalize: bool,
                                  dtype: torch.dtype) -> None:
    router = _router(top_k, dtype, score_func=score_func, renormalize=renormalize)
    x = torch.randn(T, D, dtype=dtype)
    result = router(x)
    w_ref = router.weight.detach().double().requires_grad_(True)
    idx_ref, weights_ref, logits_ref = reference_route(x.double(), w_ref, top_k, score_func,
                                                       renormalize)
    assert result.top_k_index.dtype == torch.int64
    assert torch.equal(result.top_k_index, idx_ref)
    assert result.logits.dtype == dtype and result.top_k_weights.dtype == dtype
    assert_close(result.logits, logits_ref, dtype=dtype)
    assert_close(result.top_k_weights, weights_ref, dtype=dtype)
    scores_ref = torch.stack([REFERENCE_SCORES[score_func](z)[0] for z in logits_ref.detach()])
    assert_close(result.scores, scores_ref, dtype=dtype)
    assert torch.equal(result.tokens_per_expert, torch.bincount(idx_ref.flatten(), minlength=E))
    if renormalize:
        assert_close(result.top_k_weights.sum(-1), torch.ones(T, dtype=torch.float64))
    # Gradient of the routing weights w.r.t. the router weight.
    probe = torch.randn(T, top_k, dtype=torch.float64)
    (result.top_k_weights * probe.to(dtype)).sum().backward()
    (weights_ref * probe).sum().backward()
    assert_close(router.weight.grad, w_ref.grad, grad=True, dtype=dtype)


def test_bf16_activations_route_in_fp32() -> None:
    router = _router(2, torch.float32)
    x = torch.randn(T, D).bfloat16()
    result = router(x)
    logits_fp32 = F.linear(x.float(), router.weight.float())
    assert result.logits.dtype == torch.float32 and result.scores.dtype == torch.float32
    assert torch.equal(result.logits, logits_fp32)
    top = logits_fp32.softmax(-1).topk(2, dim=-1)
    assert torch.equal(result.top_k_index, top.indices)
    expected = top.values / top.values.sum(-1, keepdim=True)
    assert result.top_k_weights.dtype == torch.bfloat16
    assert torch.equal(result.top_k_weights, expected.bfloat16())  # one cast, at the end


def test_bf16_router_weight_is_upcast() -> None:
    router = _router(2, torch.bfloat16)
    x = torch.randn(T, D).bfloat16()
    result = router(x)
    assert result.logits.dtype == torch.float32
    assert torch.equal(result.logits, F.linear(x.float(), router.weight.float()))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_selection_bias_selects_but_does_not_weight(score_func: str) -> None:
    router = _router(2, torch.float32, score_func=score_func)
    x = torch.randn(T, D)
    plain = router(x)
    router.selection_bias[3] = 10.0  # every token now selects expert 3
    biased = router(x)
    assert bool((biased.top_k_index == 3).any(-1).all())
    assert torch.equal(biased.logits, plain.logits) and torch.equal(biased.scores, plain.scores)
    expected_TK = plain.scores.gather(1, biased.top_k_index)
    expected_TK = expected_TK / expected_TK.sum(-1, keepdim=True)
    # unbiased scores, renormalised (sigmoid: as a softmax of log σ, equal up to rounding)
    assert_close(biased.top_k_weights, expected_TK)
    other = biased.top_k_index[biased.top_k_index != 3].view(T)
    masked = plain.scores.clone()
    masked[:, 3] = -1
    assert torch.equal(other, masked.argmax(-1))  # the second pick is the best unbiased one


def test_selection_bias_shape_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^selection_bias must be \(E,\) with E=5, got \(4,\)$"):
        route(torch.randn(T, E), 2, selection_bias_E=torch.zeros(4))


def test_padding_mask_is_excluded_from_counts_and_losses() -> None:
    router = _router(2, torch.float32)
    x = torch.randn(T, D)
    mask = torch.rand(T) > 0.4
    mask[0], mask[1] = True, False
    result = router(x, mask)
    valid = router(x[mask])
    assert torch.equal(result.top_k_index[~mask], torch.full((int((~mask).sum()), 2), E))
    assert torch.equal(result.top_k_weights[~mask], torch.zeros(int((~mask).sum()), 2))
    assert torch.equal(result.top_k_index[mask], valid.top_k_index)
    assert_close(result.top_k_weights[mask], valid.top_k_weights)  # matmul of another T
    assert torch.equal(result.tokens_per_expert, valid.tokens_per_expert)
    assert int(result.tokens_per_expert.sum()) == 2 * int(mask.sum())
    lbl = load_balancing_loss(result.logits, result.top_k_index, mask)
    assert_close(lbl, load_balancing_loss(valid.logits, valid.top_k_index))
    assert_close(z_loss(result.logits, mask), z_loss(valid.logits))


@pytest.mark.parametrize("top_k", [1, 3, E])
def test_tokens_per_expert_sums_to_k_times_tokens(top_k: int) -> None:
    result = route(torch.randn(T, E), top_k)
    assert result.tokens_per_expert.dtype == torch.int64
    assert int(result.tokens_per_expert.sum()) == top_k * T
    assert torch.equal(result.tokens_per_expert,
                       torch.bincount(result.top_k_index.flatten(), minlength=E))
    assert all(len(set(row)) == top_k for row in result.top_k_index.tolist())  # distinct


def test_zero_tokens() -> None:
    result = route(torch.zeros(0, E), 2)
    assert result.top_k_index.shape == (0, 2) and result.top_k_weights.shape == (0, 2)
    assert torch.equal(result.tokens_per_expert, torch.zeros(E, dtype=torch.int64))


def test_route_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^logits must be \(T, E\), got shape \(2, 3, 4\)$"):
        route(torch.zeros(2, 3, 4), 1)
    with pytest.raises(ValueError, match=r"^top_k must be in \[1, num_experts=5\], got 6$"):
        route(torch.zeros(2, E), 6)
    names = sorted(SCORE_FUNCTIONS)  # the one score-function table
    with pytest.raises(ValueError, match=f"^{re.escape(f'score_func must be one of {names}')}, "
                                         "got 'x'$"):
        route(torch.zeros(2, E), 1, score_func="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^valid_mask must be bool or an integer 0/1 mask"):
        route(torch.zeros(2, E), 1, valid_mask_T=torch.ones(2))
    with pytest.raises(ValueError, match=r"^valid_mask must have the token shape \(T,\)=\(2,\)"):
        route(torch.zeros(2, E), 1, valid_mask_T=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^top_k must be in \[1, num_experts=5\], got 0$"):
        TopKRouter(D, E, 0)


def test_a_moe_config_is_the_route_options_of_its_layer() -> None:
    # MoEConfig inherits RouteOptions' fields: route() takes the layer's config as it is, and
    # decides exactly as with the same six options given on their own.
    moe = MoEConfig(hidden_size=D, intermediate_size=D, num_experts=8, top_k=3,
                    capacity_factor=0.5, drop_policy="position", n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, score_func="sigmoid")
    options = RouteOptions(capacity_factor=0.5, drop_policy="position", n_group=4,
                           topk_group=2, routed_scaling_factor=2.5)
    logits = torch.randn(T, 8, dtype=torch.float64)
    got = route(logits, 3, score_func="sigmoid", options=moe)
    want = route(logits, 3, score_func="sigmoid", options=options)
    plain = route(logits, 3, score_func="sigmoid")
    assert torch.equal(got.top_k_index, want.top_k_index)
    assert torch.equal(got.top_k_weights, want.top_k_weights)
    # capacity ⌈0.5·12·3/8⌉ = 3 per expert: some of the 36 pairs are dropped
    assert int(got.dropped_pairs) == int(want.dropped_pairs) > 0
    assert not torch.equal(got.selected_index, plain.selected_index)  # groups took effect
    assert MoELayer(moe).router.options is moe


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"score_func": "sigmoid"}, "score_func='softmax' but route got score_func='sigmoid'"),
    ({"renormalize": False}, "renormalize=True but route got renormalize=False"),
    ({"top_k": 2}, "top_k=3 but route got top_k=2"),
])
def test_a_moe_config_that_disagrees_with_routes_arguments_is_refused(
        kwargs: dict[str, object], field: str) -> None:
    # route() takes k, the score function and renormalisation as its own arguments; a config
    # whose values differ would otherwise be silently half-applied.
    moe = MoEConfig(hidden_size=D, intermediate_size=D, num_experts=8, top_k=3)
    args = {"top_k": 3, "score_func": "softmax", "renormalize": True, **kwargs}
    top_k = args.pop("top_k")
    with pytest.raises(ValueError, match=re.escape(field)):
        route(torch.randn(T, 8), top_k, options=moe, **args)  # type: ignore[arg-type]
    route(torch.randn(T, 8), 3, options=moe)  # agreeing values route
