"""Numeric faults fixed as kinds: extreme logits, tie-breaking, mask validation in the losses."""

from __future__ import annotations

import pytest
import torch

from memfine.reference import reference_route
from memfine.routing import (
    RouteOptions,
    check_token_mask,
    load_balancing_loss,
    route,
    top_k_lowest_index,
    z_loss,
)
from tolerances import assert_close


@pytest.mark.parametrize("level", [-100.0, -1000.0, 100.0])
def test_sigmoid_extreme_logits(level: float) -> None:
    """σ underflows to 0 (or saturates at 1): choose by logit, weights finite and summing to 1."""
    T, E, k = 4, 8, 2
    logits = level + torch.linspace(-1, 1, E).roll(3) + 0.1 * torch.arange(T)[:, None]
    result = route(logits, k, score_func="sigmoid", renormalize=True)
    assert result.top_k_index.tolist() == logits.topk(k).indices.tolist()  # top-2 by logit
    assert bool(torch.isfinite(result.top_k_weights).all())
    assert_close(result.top_k_weights.sum(-1), torch.ones(T))
    ref_idx, ref_w, _ = reference_route(logits.double(), torch.eye(E, dtype=torch.float64), k,
                                        "sigmoid")
    assert torch.equal(result.top_k_index, ref_idx)
    assert_close(result.top_k_weights, ref_w.float())
    if level == -100.0:  # σ(z) ≈ e^z there, so the weights are a softmax of the two logits
        expected = logits.double().gather(1, ref_idx).softmax(-1)
        assert_close(result.top_k_weights, expected.float())
    grad = torch.autograd.grad(route(logits.requires_grad_(True), k, score_func="sigmoid")
                               .top_k_weights[:, 0].sum(), logits)[0]
    assert bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_softmax_extreme_and_low_precision_logits(dtype: torch.dtype) -> None:
    big = 1e4 if dtype != torch.float16 else 6e4
    logits = torch.tensor([[big, -big, 0.0, 1.0], [0.0, big, big - 1, -big]]).to(dtype)
    result = route(logits, 2)
    assert result.top_k_index.tolist() == [[0, 3], [1, 2]]
    assert result.top_k_weights.dtype == dtype
    assert bool(torch.isfinite(result.top_k_weights.float()).all())
    tol = torch.bfloat16 if dtype == torch.float16 else dtype  # the table's low-precision row
    assert_close(result.top_k_weights.float().sum(-1), torch.ones(2), dtype=tol)
    ref_idx, ref_w, _ = reference_route(logits.double(), torch.eye(4, dtype=torch.float64), 2)
    assert torch.equal(result.top_k_index, ref_idx)
    assert_close(result.top_k_weights.double(), ref_w, dtype=tol)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_ties_go_to_the_lowest_index(score_func: str) -> None:
    assert route(torch.zeros(3, 8), 3, score_func=score_func).top_k_index.tolist() == \
        [[0, 1, 2]] * 3
    row = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert route(row, 2, score_func=score_func).top_k_index.tolist() == [[1, 2]]
    # a grid of small integers has ties everywhere: router and reference agree on every row
    logits = torch.randint(0, 3, (64, 6)).double()
    for k in (1, 2, 4):
        ref_idx, _, _ = reference_route(logits, torch.eye(6, dtype=torch.float64), k,
                                        score_func, renormalize=k > 1)
        got = route(logits, k, score_func=score_func, renormalize=k > 1).top_k_index
        assert torch.equal(got, ref_idx), k


@pytest.mark.parametrize("seed", range(4))
def test_fp32_top_k_is_the_stable_descending_sort(seed: int) -> None:
    """fp32 scores go through int64 keys, not a sort: the same experts as a stable descending
    sort (the independent reference), on ties, ±0.0, ±inf and NaNs of either sign."""
    gen = torch.Generator().manual_seed(seed)
    T, E = 257, 12
    scores = torch.randint(-3, 4, (T, E), generator=gen).float()  # ties in every row
    scores[scores == -3], scores[scores == 3] = float("-inf"), float("inf")
    cells = torch.rand(T, E, generator=gen)
    scores[cells < 0.1] = -0.0
    scores[(cells >= 0.1) & (cells < 0.15)] = float("nan")
    scores[(cells >= 0.15) & (cells < 0.2)] = -float("nan")
    scores[-1] = torch.linspace(-2e-38, 2e-38, E)  # denormals and tiny normals
    for k in (1, 3, E):
        expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(top_k_lowest_index(scores, k), expected), k
        assert torch.equal(top_k_lowest_index(scores.double(), k), expected), k


def test_losses_accept_integer_masks_as_masks() -> None:
    T, E, k = 6, 4, 2
    logits = torch.randn(T, E)
    index = route(logits, k).top_k_index
    mask_int = torch.tensor([1, 1, 0, 1, 0, 1])
    rows = mask_int.bool()
    expected_lbl = load_balancing_loss(logits[rows], index[rows])  # padding rows removed
    expected_z = z_loss(logits[rows])
    for mask in (mask_int, mask_int.int(), mask_int.to(torch.uint8), rows):
        assert torch.equal(load_balancing_loss(logits, index, mask), expected_lbl)
        assert torch.equal(z_loss(logits, mask), expected_z)
    # the old fault: an int64 0/1 mask used as row indices gives a different value
    assert not torch.allclose(load_balancing_loss(logits[mask_int], index[mask_int]),
                              expected_lbl)


def test_route_accepts_integer_masks_nonzero_is_a_real_token() -> None:
    logits = torch.randn(6, 4)
    rows = torch.tensor([True, True, False, True, False, True])
    expected = route(logits, 2, valid_mask_T=rows)
    for mask in (rows.long(), rows.int(), torch.tensor([3, 1, 0, -1, 0, 1])):
        result = route(logits, 2, valid_mask_T=mask)
        assert result.valid_mask is not None and result.valid_mask.dtype == torch.bool
        assert torch.equal(result.valid_mask, rows)
        assert torch.equal(result.top_k_index, expected.top_k_index)
        assert torch.equal(result.top_k_weights, expected.top_k_weights)
        assert torch.equal(check_token_mask(mask, 6), rows)


@pytest.mark.parametrize(("mask", "match"), [
    (torch.ones(5, dtype=torch.bool), r"valid_mask must have the token shape \(T,\)=\(6,\), "
                                      r"got \(5,\)"),
    (torch.ones(6, 1, dtype=torch.bool), r"got \(6, 1\)"),
    (torch.ones(6), r"valid_mask must be bool or an integer 0/1 mask \(nonzero = a real "
                    r"token\), got torch.float32 \(a float mask is ambiguous: additive -inf\)$"),
])
def test_losses_reject_bad_masks(mask: torch.Tensor, match: str) -> None:
    logits, index = torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        load_balancing_loss(logits, index, mask)
    with pytest.raises(ValueError, match=match):
        z_loss(logits, mask)
    with pytest.raises(ValueError, match=match):
        check_token_mask(mask, 6)


def test_routed_scaling_factor_applies_after_renormalisation() -> None:
    logits = torch.randn(5, 8)
    for score_func in ("softmax", "sigmoid"):
        plain = route(logits, 2, score_func=score_func)
        scaled = route(logits, 2, score_func=score_func,
                       options=RouteOptions(routed_scaling_factor=2.5))
        assert torch.equal(scaled.top_k_index, plain.top_k_index)
        assert_close(scaled.top_k_weights, 2.5 * plain.top_k_weights)
        assert_close(scaled.top_k_weights.sum(-1), torch.full((5,), 2.5))


@pytest.mark.parametrize("options", ["x", None, {"n_group": 1}])
def test_route_refuses_options_of_another_type(options: object) -> None:
    with pytest.raises(TypeError, match=rf"^options must be a RouteOptions or a MoEConfig, got "
                       rf"{type(options).__name__} "):
        route(torch.zeros(2, 4), 2, options=options)  # type: ignore[arg-type]
