"""The router's score functions: one table that the router, the config check and the docs read.

Legend: T tokens, E experts, K top-k slots.
Each entry maps fp32 logits to scores and says how the k selected scores are renormalised.
Every score function here is monotone in each logit (softmax within a row), so without a
selection bias or groups the router ranks by logit (docs/design.md §2).
Adding a score function (docs/extending.md): one :class:`ScoreFunction` entry in
:data:`SCORE_FUNCTIONS` here and its name in :data:`memfine.config.ScoreFunc` (the config check
and ``--score-func`` read it), then the test oracle's own formula in
``memfine.reference.REFERENCE_SCORES`` and a row in docs/design.md §2. Each half-done state fails
with a message: importing this module names a table/``ScoreFunc`` difference, and
tests/routing/test_scores.py names an entry without a reference formula or a doc row (the
router, the renormalisation, the underflow and the config tests then cover the entry as they
cover every other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F

from memfine._checks import lookup
from memfine.config import ScoreFunc

# softplus(z) = log1p(e^z) → e^z below this logit, so log softplus(z) = z to fp32 precision.
_SOFTPLUS_LOG_LINEAR_BELOW = -20.0


def _log_softplus(z: torch.Tensor) -> torch.Tensor:
    """Log softplus(z), finite for every finite z (softplus underflows to 0 below about -104)."""
    safe = torch.where(z < _SOFTPLUS_LOG_LINEAR_BELOW, 0.0, z)
    return torch.where(z < _SOFTPLUS_LOG_LINEAR_BELOW, z, F.softplus(safe).log())


@dataclass(frozen=True, slots=True)
class ScoreFunction:
    """One router score function.

    Attributes:
        name: the ``score_func`` value (``MoEConfig.score_func``, ``--score-func``).
        formula: the scores as written in the docs (docs/design.md §2 lists every entry).
        scores: (T, E) fp32 logits → (T, E) fp32 scores.
        log_scores: elementwise log of the scores, used to renormalise the k selected scores as
            a softmax of their logs (finite and summing to 1 where every score underflows to 0);
            None for a distribution over E (softmax), whose top score is >= 1/E, so the plain
            ratio s_j / Σ_k s never divides by 0.
        source: where the function comes from.
    """

    name: str
    formula: str
    scores: Callable[[torch.Tensor], torch.Tensor]
    log_scores: Callable[[torch.Tensor], torch.Tensor] | None
    source: str

    def renormalized(self, logits_TK: torch.Tensor, scores_TK: torch.Tensor) -> torch.Tensor:
        """(T, k) weights s_j / Σ s over the k selected (logits and scores of those k)."""
        if self.log_scores is not None:
            return self.log_scores(logits_TK).softmax(-1)
        return scores_TK / scores_TK.sum(-1, keepdim=True)


SCORE_FUNCTIONS: dict[str, ScoreFunction] = {
    f.name: f for f in (
        ScoreFunction(name="softmax", formula="softmax(z) over the E experts",
                      scores=lambda z: z.softmax(-1), log_scores=None,
                      source="Switch Transformer, Mixtral, Qwen-MoE"),
        ScoreFunction(name="sigmoid", formula="σ(z) = 1 / (1 + e^-z), elementwise",
                      scores=torch.sigmoid, log_scores=F.logsigmoid,
                      source="DeepSeek-V3 §2.1.2"),
        ScoreFunction(name="sqrtsoftplus", formula="sqrt(softplus(z)) = sqrt(log(1 + e^z)), "
                      "elementwise", scores=lambda z: F.softplus(z).sqrt(),
                      log_scores=lambda z: 0.5 * _log_softplus(z),
                      source="Megatron-LM (moe_router_score_function='sqrtsoftplus')"),
    )
}
"""Every score function by name; the keys are exactly :data:`memfine.config.ScoreFunc`."""

if set(SCORE_FUNCTIONS) != set(get_args(ScoreFunc)):  # a memfine bug, caught at import
    raise ImportError(f"memfine.config.ScoreFunc {get_args(ScoreFunc)} and the score-function "
                      f"table {tuple(SCORE_FUNCTIONS)} must list the same names")


def score_function(name: str) -> ScoreFunction:
    """The table entry for ``name``; ValueError naming ``score_func`` and the known names."""
    return lookup(SCORE_FUNCTIONS, name, "score_func")
