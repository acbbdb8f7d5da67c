"""The score-function table: every entry routes as its independent reference formula says.

The router, the config check and docs/design.md §2 read one table (memfine.routing.scores);
memfine.reference keeps its own formulas, so an entry without one fails here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import get_args

import pytest
import torch

from memfine.config import MoEConfig, ScoreFunc
from memfine.reference import REFERENCE_SCORES, reference_route
from memfine.routing import route
from memfine.routing.scores import SCORE_FUNCTIONS
from tolerances import assert_close

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
NAMES = sorted(SCORE_FUNCTIONS)


def test_every_table_entry_has_a_reference_formula() -> None:
    assert set(SCORE_FUNCTIONS) == set(get_args(ScoreFunc))
    missing = sorted(set(SCORE_FUNCTIONS) - set(REFERENCE_SCORES))
    assert missing == [], f"score functions without a reference formula: {missing}"


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("score_func", NAMES)
def test_route_matches_the_reference_formula(score_func: str, renormalize: bool) -> None:
    logits = torch.randn(16, 6, dtype=torch.float64) * 3
    got = route(logits, 3, score_func=score_func, renormalize=renormalize)  # type: ignore[arg-type]
    idx, weights, _ = reference_route(logits, torch.eye(6, dtype=torch.float64), 3, score_func,
                                      renormalize)
    scores = torch.stack([REFERENCE_SCORES[score_func](z)[0] for z in logits])
    assert_close(got.scores, scores)
    assert torch.equal(got.top_k_index, idx)
    assert_close(got.top_k_weights, weights)


def test_sqrtsoftplus_scores_are_megatron_s() -> None:
    """sqrt(softplus(z)), renormalised over the k: not the sigmoid path under another name."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 4.0]], dtype=torch.float64)
    got = route(logits, 2, score_func="sqrtsoftplus")
    softplus = [math_softplus(v) for v in logits[0].tolist()]
    assert_close(got.scores[0], torch.tensor(softplus, dtype=torch.float64).sqrt())
    s3, s0 = softplus[3] ** 0.5, softplus[0] ** 0.5
    assert got.top_k_index.tolist() == [[3, 0]]
    assert_close(got.top_k_weights[0], torch.tensor([s3, s0], dtype=torch.float64) / (s3 + s0))
    sigmoid = route(logits, 2, score_func="sigmoid")
    assert not torch.allclose(got.top_k_weights, sigmoid.top_k_weights)


def math_softplus(z: float) -> float:
    """log(1 + e^z) in plain Python floats."""
    return math.log1p(math.exp(z))


@pytest.mark.parametrize("score_func", [n for n in NAMES if SCORE_FUNCTIONS[n].log_scores])
@pytest.mark.parametrize("level", [-50.0, -200.0, -1e4])
def test_elementwise_scores_renormalise_where_they_underflow(score_func: str,
                                                             level: float) -> None:
    logits = torch.tensor([[level, level - 1, level - 3, level + 0.5]])
    got = route(logits, 2, score_func=score_func)  # type: ignore[arg-type]
    assert bool(torch.isfinite(got.top_k_weights).all())
    assert_close(got.top_k_weights.sum(-1), torch.ones(1))
    assert got.top_k_index.tolist() == [[3, 0]]  # ranked by logit where scores tie at 0
    grad = torch.autograd.grad(route(logits.requires_grad_(True), 2, score_func=score_func)
                               .top_k_weights[0, 0], logits)[0]
    assert bool(torch.isfinite(grad).all())


def test_config_accepts_exactly_the_table() -> None:
    for name in NAMES:
        assert MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                         score_func=name).score_func == name  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"MoEConfig.score_func must be one of .*'sqrtsoftplus'"):
        MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                  score_func="tanh")  # type: ignore[arg-type]


def test_design_doc_lists_the_table() -> None:
    rows = re.findall(r"^\s*\| `(\w+)` \| (.+?) \| (.+?) \| (.+?) \|$", DESIGN.read_text(),
                      re.MULTILINE)
    documented = {name: (formula, renorm, source) for name, formula, renorm, source in rows}
    missing, extra = set(SCORE_FUNCTIONS) - set(documented), set(documented) - set(SCORE_FUNCTIONS)
    assert not missing and not extra, (f"docs/design.md §2's score-function table: add rows for "
                                       f"{sorted(missing)}, remove {sorted(extra)}")
    for name, entry in SCORE_FUNCTIONS.items():
        renorm = "s_j / Σ_k s" if entry.log_scores is None else "softmax of log s over the k"
        assert documented[name] == (entry.formula, renorm, entry.source), name


def test_unknown_score_function_is_refused_by_route() -> None:
    with pytest.raises(ValueError, match=r"^score_func must be one of .*, got 'tanh'$"):
        route(torch.zeros(2, 4), 1, score_func="tanh")  # type: ignore[arg-type]
