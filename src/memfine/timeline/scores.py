"""Allocation timeline of the router's score functions and renormalisation, one entry per name.

The entries mirror :data:`memfine.routing.scores.SCORE_FUNCTIONS` (same names, checked at
import): how the (T, E) scores are computed from the logits and what their backward allocates,
and for elementwise scores how the k selected weights are renormalised as a softmax of the log
scores at the k gathered logits (softmax's ratio s_j / Σ s is in
:mod:`memfine.layer_timeline.layer`).

Legend: T tokens, K = k, E experts, R router bytes. The allocator's one-element temporaries
(Python scalars, ``any``) are left out: they never meet a peak.
Reference: our derivation from the code and torch.profiler's allocator events
(tests/memory/test_layer.py, every router kind); docs/design.md §5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

from memfine.config import ScoreFunc
from memfine.timeline.base import Timeline, engine_sum

Names = dict[str, str]


@dataclass(frozen=True, slots=True)
class Sizes:
    """T, K, E and R of the router (bytes per element in ``r``)."""

    T: int
    K: int
    E: int
    r: int

    @property
    def te(self) -> int:
        """Bytes of one (T, E) router tensor."""
        return self.T * self.E * self.r

    @property
    def tk(self) -> int:
        """Bytes of one (T, K) router tensor."""
        return self.T * self.K * self.r


@dataclass(frozen=True, slots=True)
class ScoreTimeline:
    """Allocations of one score function, forward and backward.

    Attributes:
        scores: forward (tl, sizes) → the scores' name; temporaries freed inside.
        scores_backward: (tl, rt, sizes, incoming (T, E) gradient) → the logits' gradient;
            frees the incoming gradient, the scores and, when ``logits_saved``, the logits.
        log_renorm: for elementwise scores, (tl, rt, sizes) → the log scores of the k gathered
            logits (``rt["top_k_logits"]``); writes the names its backward keeps into ``rt``.
            None for softmax (renormalised as a ratio).
        log_renorm_backward: (tl, rt, sizes, incoming (T, K) gradient of the log scores) → the
            gradient of the k gathered logits.
        logits_saved: the scores' backward keeps the (T, E) logits (softplus), so they outlive
            the z-loss's backward (and, where that backward never runs, the region).
    """

    scores: Callable[[Timeline, Sizes], str]
    scores_backward: Callable[[Timeline, Names, Sizes, str], str]
    log_renorm: Callable[[Timeline, Names, Sizes], str] | None
    log_renorm_backward: Callable[[Timeline, Names, Sizes, str], str] | None
    logits_saved: bool


def _one_op(tl: Timeline, s: Sizes) -> str:
    """Softmax / sigmoid: one (T, E) result, saved by its backward."""
    return tl.alloc("router.scores", s.te)


def _result_backward(tl: Timeline, rt: Names, s: Sizes, grad: str) -> str:
    """Softmax / sigmoid backward from the saved result: one (T, E) buffer."""
    out = tl.alloc("rbwd.dlogits", s.te)
    tl.free(grad, rt["scores"])
    return out


def _sqrtsoftplus(tl: Timeline, s: Sizes) -> str:
    """softplus(z) (its backward keeps z), then sqrt (keeps its result); softplus freed."""
    softplus = tl.alloc("router.softplus", s.te)
    scores = tl.alloc("router.scores", s.te)
    tl.free(softplus)
    return scores


def _sqrtsoftplus_backward(tl: Timeline, rt: Names, s: Sizes, grad: str) -> str:
    """SqrtBackward (grad / (2·result)), then SoftplusBackward on the kept logits."""
    two = tl.alloc("rbwd.two_sqrt", s.te)
    div = tl.alloc("rbwd.dsqrt", s.te)
    tl.free(two, grad, rt["scores"])
    out = tl.alloc("rbwd.dlogits", s.te)
    tl.free(div, rt.pop("logits"))
    return out


def _log_sigmoid(tl: Timeline, rt: Names, s: Sizes) -> str:
    """log_sigmoid_forward: output and a buffer; its backward keeps the input and the buffer."""
    out = tl.alloc("router.log_scores", s.tk)
    rt["buffer"] = tl.alloc("router.log_sigmoid_buffer", s.tk)
    return out


def _log_sigmoid_backward(tl: Timeline, rt: Names, s: Sizes, grad: str) -> str:
    out = tl.alloc("rbwd.dlog_sigmoid", s.tk)
    tl.free(grad, rt.pop("top_k_logits"), rt.pop("buffer"))
    return out


def _half_log_softplus(tl: Timeline, rt: Names, s: Sizes) -> str:
    """0.5 · where(z < -20, z, log softplus(where(z < -20, 0, z))), z the gathered logits.

    Kept for backward: both (T, K) bool masks, the clamped logits and softplus; not z.
    """
    rt["mask1"] = tl.alloc("router.log_mask", s.T * s.K)
    rt["safe"] = tl.alloc("router.log_safe", s.tk)
    rt["mask2"] = tl.alloc("router.log_mask", s.T * s.K)
    rt["softplus_k"] = tl.alloc("router.log_softplus", s.tk)
    log = tl.alloc("router.log", s.tk)
    where = tl.alloc("router.log_where", s.tk)
    tl.free(log)
    rt["half"] = tl.alloc("router.half_scalar", 8)  # 0.5 wrapped as a tensor, MulBackward keeps it
    half = tl.alloc("router.log_scores", s.tk)
    tl.free(where)
    rt["top_k_logits_unsaved"] = rt["top_k_logits"]
    return half


def _half_log_softplus_backward(tl: Timeline, rt: Names, s: Sizes, grad: str) -> str:
    """MulBackward, WhereBackward (two branches), LogBackward, SoftplusBackward, WhereBackward."""
    half = tl.alloc("rbwd.dhalf", s.tk)
    tl.free(grad, rt.pop("half"))
    branch_z, branch_log = tl.alloc("rbwd.where_z", s.tk), tl.alloc("rbwd.where_log", s.tk)
    tl.free(half, rt.pop("mask2"))
    div = tl.alloc("rbwd.dlog", s.tk)
    tl.free(branch_log, rt.pop("softplus_k"))
    dsoftplus = tl.alloc("rbwd.dsoftplus", s.tk)
    tl.free(div, rt.pop("safe"))
    branch_safe = tl.alloc("rbwd.where_safe", s.tk)
    tl.free(dsoftplus, rt.pop("mask1"))
    return engine_sum(tl, branch_z, branch_safe)  # both reach z: the engine adds in place


SCORE_TIMELINES: dict[str, ScoreTimeline] = {
    "softmax": ScoreTimeline(_one_op, _result_backward, None, None, logits_saved=False),
    "sigmoid": ScoreTimeline(_one_op, _result_backward, _log_sigmoid, _log_sigmoid_backward,
                             logits_saved=False),
    "sqrtsoftplus": ScoreTimeline(_sqrtsoftplus, _sqrtsoftplus_backward, _half_log_softplus,
                                  _half_log_softplus_backward, logits_saved=True),
}
"""The timeline of every score function; the keys are exactly :data:`memfine.config.ScoreFunc`."""

if set(SCORE_TIMELINES) != set(get_args(ScoreFunc)):  # a memfine bug, caught at import
    raise ImportError(f"memfine.config.ScoreFunc {get_args(ScoreFunc)} and the score-function "
                      f"timelines {tuple(SCORE_TIMELINES)} must list the same names")

