"""Top-k router in fp32 and its frozen result.

Legend: T tokens, E experts, K top-k slots, D hidden size.
Reference: docs/design.md §2 (fp32 router; selection bias is used for selection only, DeepSeek-V3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfine.config import ScoreFunc
from memfine.routing.precision import FP32BuffersMixin, count_per_expert, fp32_routing


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compute dtype of the router: fp32, or float64 for float64 inputs (references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class RoutingResult:
    """What the router decided for T tokens; computed once per layer and step, never recomputed.

    Attributes:
        top_k_index: (T, k) int64 expert ids; padding tokens hold the sentinel E (never
            dispatched).
        top_k_weights: (T, k) routing weights in the activation dtype (the final cast of the fp32
            computation); 0 for padding tokens.
        logits: (T, E) fp32 raw router logits x·W_rᵀ.
        scores: (T, E) fp32 router scores (softmax or sigmoid of the logits, before any
            selection bias).
        tokens_per_expert: (E,) int64 count of (token, slot) assignments per expert, padding
            excluded; sums to k·(valid tokens).
        valid_mask: (T,) bool, False for padding tokens, or None when every token is valid.
    """

    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor
    tokens_per_expert: torch.Tensor
    valid_mask: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        """E, the number of routed experts."""
        return int(self.logits.shape[-1])

    @property
    def top_k(self) -> int:
        """k, experts per token."""
        return int(self.top_k_index.shape[-1])


@fp32_routing
def route(logits_TE: torch.Tensor, top_k: int, *, score_func: ScoreFunc = "softmax",
          renormalize: bool = True, selection_bias_E: torch.Tensor | None = None,
          valid_mask_T: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> RoutingResult:
    """Select k experts per token from router logits, in fp32.

    Args:
        logits_TE: (T, E) router logits, any float dtype (upcast to fp32 here; float64 stays).
        top_k: k in [1, E].
        score_func: ``softmax`` over E or elementwise ``sigmoid``.
        renormalize: divide the k selected scores by their sum (no epsilon: sigmoid scores of
            e^-60 still renormalise to weights that sum to 1).
        selection_bias_E: optional (E,) fp32 bias added to the scores for top-k selection only
            (aux-loss-free balancing, or a skew knob for experiments); weights use unbiased scores.
        valid_mask_T: optional (T,) bool, False marks padding tokens: they get the sentinel
            expert id E, weight 0, and are left out of ``tokens_per_expert``.
        out_dtype: dtype of ``top_k_weights`` (default: the dtype of ``logits_TE``).

    Returns:
        A :class:`RoutingResult`.

    Raises:
        ValueError: if logits are not 2-D, top_k is out of range, score_func is unknown, or the
            mask/bias shapes do not match.

    Reference: docs/design.md §2.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be (T, E), got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, num_experts={E}], got {top_k}")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    out_dtype = out_dtype or logits_TE.dtype
    logits_TE = logits_TE.to(router_dtype(logits_TE.dtype))
    scores_TE = logits_TE.softmax(-1) if score_func == "softmax" else logits_TE.sigmoid()
    select_TE = scores_TE.detach()
    if selection_bias_E is not None:
        if selection_bias_E.shape != (E,):
            raise ValueError(f"selection_bias must be (E,) with E={E}, "
                             f"got {tuple(selection_bias_E.shape)}")
        select_TE = select_TE + selection_bias_E.to(select_TE.dtype)
    top_k_index_TK = select_TE.topk(top_k, dim=-1, sorted=True).indices
    weights_TK = scores_TE.gather(1, top_k_index_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    if valid_mask_T is not None:
        if valid_mask_T.shape != (T,) or valid_mask_T.dtype != torch.bool:
            raise ValueError(f"valid_mask must be (T,) bool with T={T}, got "
                             f"{tuple(valid_mask_T.shape)} {valid_mask_T.dtype}")
        keep_TK = valid_mask_T[:, None].expand(T, top_k)
        top_k_index_TK = torch.where(keep_TK, top_k_index_TK, E)
        weights_TK = torch.where(keep_TK, weights_TK, 0.0)
    counts = count_per_expert(top_k_index_TK, E)
    return RoutingResult(top_k_index=top_k_index_TK, top_k_weights=weights_TK.to(out_dtype),
                         logits=logits_TE, scores=scores_TE, tokens_per_expert=counts,
                         valid_mask=valid_mask_T)


class TopKRouter(FP32BuffersMixin):
    """Linear router x·W_rᵀ computed in fp32, followed by :func:`route`.

    Everything runs in fp32 with autocast disabled (:func:`fp32_routing`), also inside a
    ``torch.autocast`` region; the selection bias stays an fp32 buffer through
    ``module.to(dtype)`` (:class:`FP32BuffersMixin`).

    Args:
        hidden_size: d.
        num_experts: E.
        top_k: k.
        score_func: ``softmax`` or ``sigmoid``.
        renormalize: renormalise the k selected weights.

    Attributes:
        weight: (E, d) parameter (kept in the module dtype; upcast to fp32 for the logits).
        selection_bias: (E,) fp32 buffer added to scores for selection only (zeros by default).

    Reference: docs/design.md §2.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 score_func: ScoreFunc = "softmax", renormalize: bool = True) -> None:
        """Create the weight (N(0, 0.02²)) and a zero selection bias; arguments as on the class.

        Raises:
            ValueError: if ``top_k`` is not in [1, num_experts].
        """
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize = score_func, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("selection_bias", torch.zeros(num_experts), persistent=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the router weight with N(0, 0.02²)."""
        nn.init.normal_(self.weight, std=0.02)

    @fp32_routing
    def forward(self, x_TD: torch.Tensor, valid_mask_T: torch.Tensor | None = None
                ) -> RoutingResult:
        """Route T tokens.

        Args:
            x_TD: (T, d) activations, any float dtype.
            valid_mask_T: optional (T,) bool; False marks padding tokens.

        Returns:
            A :class:`RoutingResult`; ``top_k_weights`` in ``x_TD.dtype``.
        """
        dtype = router_dtype(x_TD.dtype)
        logits_TE = F.linear(x_TD.to(dtype), self.weight.to(dtype))
        bias = self.selection_bias
        return route(logits_TE, self.top_k, score_func=self.score_func,
                     renormalize=self.renormalize,
                     selection_bias_E=bias,  # a zero bias selects as no bias: no host sync
                     valid_mask_T=valid_mask_T, out_dtype=x_TD.dtype)
