"""Capacity, token dropping and group-limited routing cases; each pytest id is the case id.

Expected values are worked out by hand in each case (or by the per-token loop of
``memfine.reference``, which ranks with Python sorts).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from memfine.config import MoEConfig
from memfine.nn import MoELayer
from memfine.reference import reference_moe, reference_route
from memfine.routing import RouteOptions, capacity_keep_mask, expert_capacity, route
from tolerances import assert_close


def _identity_layer(E: int, k: int, **overrides: object) -> MoELayer:
    """A layer with d = E and router weight I, so the router logits equal the input."""
    config = MoEConfig(hidden_size=E, intermediate_size=8, num_experts=E, top_k=k,
                       renormalize=k > 1, **overrides)  # type: ignore[arg-type]
    layer = MoELayer(config).double()
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(E, dtype=torch.float64))
        layer.experts.w_up.normal_()
        layer.experts.w_down.normal_()
    return layer


def _reference(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = layer.config
    out, idx, _ = reference_moe(
        x, layer.router.weight, layer.experts.w_up, layer.experts.w_down, c.top_k,
        score_func=c.score_func, renormalize=c.renormalize, capacity_factor=c.capacity_factor,
        min_capacity=c.min_capacity, drop_policy=c.drop_policy, n_group=c.n_group,
        topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor)
    return out, idx


def case_capacity_overflow() -> None:
    for policy in ("position", "probs"):  # equal weights: ties go to the earlier token
        layer = _identity_layer(4, 1, capacity_factor=1.0, min_capacity=4, drop_policy=policy)
        x = torch.tensor([[1.0, 0, 0, 0]] * 5, dtype=torch.float64, requires_grad=True)
        out, aux = layer(x)
        assert expert_capacity(5, 4, 1, 1.0, 4) == 4  # max(4, ceil(5/4) = 2), ≤ T = 5
        assert aux.tokens_per_expert.tolist() == [4, 0, 0, 0]
        assert int(aux.dropped_pairs) == 1
        assert torch.equal(out[4], torch.zeros(4, dtype=torch.float64))  # exactly zero
        assert bool((out[:4] != 0).any(-1).all())
        ref, idx = _reference(layer, x.detach())
        assert idx.flatten().tolist() == [0, 0, 0, 0, 4]
        assert_close(out, ref)
        out.sum().backward()
        assert x.grad is not None and torch.equal(x.grad[4], torch.zeros(4, dtype=torch.float64))


def case_capacity_clamp() -> None:
    assert expert_capacity(4, 2, 2, 2.0) == 4  # ceil(2·4·2/2) = 8, clamped to T = 4
    x = torch.randn(4, 2, dtype=torch.float64)
    dropless = _identity_layer(2, 2)
    capped = _identity_layer(2, 2, capacity_factor=2.0)
    capped.load_state_dict(dropless.state_dict())
    out_a, aux_a = dropless(x)
    out_b, aux_b = capped(x)
    assert int(aux_b.dropped_pairs) == 0 and aux_a.dropped_pairs is None
    assert torch.equal(out_a, out_b)
    assert torch.equal(aux_a.tokens_per_expert, aux_b.tokens_per_expert)


def case_capacity_negative_logits() -> None:
    T, E, k = 8, 4, 2
    logits = -1 - 2 * torch.rand(T, E, dtype=torch.float64)  # all in [-3, -1]
    result = route(logits, k, options=RouteOptions(capacity_factor=1.0))
    capacity = expert_capacity(T, E, k, 1.0)
    assert capacity == 4
    dropless = route(logits, k)
    chosen = dropless.top_k_index
    weights = dropless.top_k_weights
    for e in range(E):  # by hand: the pairs that chose e, best weight first, first `capacity`
        pairs = sorted(((float(weights[t, j]), -t, j) for t in range(T) for j in range(k)
                        if chosen[t, j] == e), reverse=True)
        kept = {(-mt, j) for _, mt, j in pairs[:capacity]}
        for t in range(T):
            for j in range(k):
                if chosen[t, j] == e:
                    assert (result.top_k_index[t, j] == e) == ((t, j) in kept)
    kept_ids = result.top_k_index[result.top_k_index < E]
    assert kept_ids.numel() == int(torch.minimum(
        torch.bincount(chosen.flatten(), minlength=E), torch.tensor(capacity)).sum())
    # no unselected pair is dispatched: every kept id is one the token chose
    assert bool(((result.top_k_index == chosen) | (result.top_k_index == E)).all())
    ref_idx, ref_w, _ = reference_route(logits, torch.eye(E, dtype=torch.float64), k,
                                        capacity_factor=1.0)
    assert torch.equal(result.top_k_index, ref_idx)
    assert_close(result.top_k_weights, ref_w)


def case_drop_policy_grid() -> None:
    E, k, T = 4, 2, 8
    x = torch.randn(T, E, dtype=torch.float64) * 2
    base = _identity_layer(E, k)
    expected_dropless, _ = base(x)
    for policy in ("probs", "position"):
        for cf in (None, 0.5, 1.0, 4.0):
            layer = _identity_layer(E, k, capacity_factor=cf, drop_policy=policy)
            layer.load_state_dict(base.state_dict())
            out, aux = layer(x)
            ref, idx = _reference(layer, x)
            assert torch.equal(aux.tokens_per_expert,
                               torch.bincount(idx[idx < E], minlength=E)), (policy, cf)
            assert_close(out, ref, msg=f"{policy} cf={cf}")
            if cf is None or cf >= 4.0:  # capacity T ≥ every expert's load: nothing dropped
                assert torch.equal(out, expected_dropless), (policy, cf)
    with pytest.raises(ValueError, match=r"MoEConfig\.drop_policy must be one of"):
        MoEConfig(hidden_size=4, intermediate_size=4, num_experts=4, top_k=2,
                  drop_policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        capacity_keep_mask(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 4, 1,
                           "random")  # type: ignore[arg-type]


def _logit(p: list[float]) -> torch.Tensor:
    t = torch.tensor(p, dtype=torch.float64)
    return (t / (1 - t)).log()


# One token, 8 experts in 4 groups {0,1} {2,3} {4,5} {6,7}; sigmoid scores:
SCORES = [0.9, 0.1, 0.6, 0.5, 0.55, 0.54, 0.2, 0.95]
# group scores (top-2 sums) 1.0, 1.1, 1.09, 1.15 → topk_group 2 keeps groups 3 and 1 → experts
# {2, 3, 6, 7}; top-2 among them: 7 (0.95), 2 (0.6). Ungrouped top-2 would be 7, 0.


def case_group_limited() -> None:
    logits = _logit(SCORES)[None]
    opts = RouteOptions(n_group=4, topk_group=2)
    plain = route(logits, 2, score_func="sigmoid")
    assert plain.top_k_index.tolist() == [[7, 0]]
    grouped = route(logits, 2, score_func="sigmoid", options=opts)
    assert grouped.top_k_index.tolist() == [[7, 2]]
    assert_close(grouped.top_k_weights, torch.tensor([[0.95, 0.6]], dtype=torch.float64) / 1.55)
    # (a) biased scores all negative: excluded groups must be -inf, not 0 (0 would win)
    bias = torch.full((8,), -2.0, dtype=torch.float64)
    biased = route(logits, 2, score_func="sigmoid", options=opts, selection_bias_E=bias)
    assert biased.top_k_index.tolist() == [[7, 2]]
    assert_close(biased.top_k_weights, grouped.top_k_weights)  # unbiased scores
    ref_idx, ref_w, _ = reference_route(logits, torch.eye(8, dtype=torch.float64), 2,
                                        "sigmoid", selection_bias=bias, n_group=4,
                                        topk_group=2)
    assert torch.equal(biased.top_k_index, ref_idx)
    assert_close(biased.top_k_weights, ref_w)
    # (b) k = 3 with -inf bias on all but expert 5: every group's top-2 sum is -inf, so the
    # tie goes to groups 0 and 1; still k distinct valid experts with finite weights, as the
    # reference decides them
    bias_b = torch.full((8,), -math.inf, dtype=torch.float64)
    bias_b[5] = 0.0
    rows = torch.randn(6, 8, dtype=torch.float64)
    result = route(rows, 3, score_func="sigmoid", options=opts, selection_bias_E=bias_b)
    for row in result.top_k_index.tolist():
        assert len(set(row)) == 3 and all(0 <= e < 8 for e in row)
    ref_b, _, _ = reference_route(rows, torch.eye(8, dtype=torch.float64), 3, "sigmoid",
                                  selection_bias=bias_b, n_group=4, topk_group=2)
    assert torch.equal(result.top_k_index, ref_b)
    ungrouped = route(rows, 3, score_func="sigmoid", selection_bias_E=bias_b)
    assert bool((ungrouped.top_k_index[:, 0] == 5).all())  # without groups 5 comes first
    assert bool(torch.isfinite(result.top_k_weights).all())
    assert_close(result.top_k_weights.sum(-1), torch.ones(6, dtype=torch.float64))
    # (c) invalid group layouts are rejected with the rule in the message
    base = {"hidden_size": 8, "intermediate_size": 8, "top_k": 2}
    for kwargs, match in [
        ({"num_experts": 6, "n_group": 4}, r"n_group must be a divisor of num_experts=6"),
        ({"num_experts": 8, "n_group": 8}, r"n_group must be at most num_experts/2=4"),
        ({"num_experts": 8, "n_group": 4, "topk_group": 5}, r"topk_group must be in \[1, 4\]"),
        ({"num_experts": 8, "n_group": 4, "topk_group": 1, "top_k": 3},
         r"topk_group must be large enough"),
    ]:
        with pytest.raises(ValueError, match=match):
            MoEConfig(**{**base, **kwargs})  # type: ignore[arg-type]


CASES: list[tuple[str, Callable[[], None]]] = [
    ("capacity-overflow", case_capacity_overflow),
    ("capacity-clamp", case_capacity_clamp),
    ("capacity-negative-logits", case_capacity_negative_logits),
    ("drop-policy-grid", case_drop_policy_grid),
    ("group-limited", case_group_limited),
]


@pytest.mark.parametrize("case", [pytest.param(fn, id=case_id) for case_id, fn in CASES])
def test_case(case: Callable[[], None]) -> None:
    case()
