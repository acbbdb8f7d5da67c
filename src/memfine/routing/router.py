"""Top-k router in fp32 and its frozen result.

Legend: T tokens, E experts, K top-k slots, D hidden size.
Reference: docs/design.md §2 (fp32 router; selection bias is used for selection only, DeepSeek-V3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfine.config import MoEConfig, RouteOptions, ScoreFunc
from memfine.routing.capacity import capacity_keep_mask, expert_capacity
from memfine.routing.groups import group_limited_scores, top_k_lowest_index
from memfine.routing.losses import check_token_mask
from memfine.routing.precision import FP32BuffersMixin, count_per_expert, fp32_routing
from memfine.routing.scores import SCORE_FUNCTIONS, score_function


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
        scores: (T, E) fp32 router scores (the score function of the logits, before any
            selection bias).
        tokens_per_expert: (E,) int64 count of (token, slot) assignments per expert, padding
            excluded; sums to k·(valid tokens).
        valid_mask: (T,) bool, False for padding tokens, or None when every token is valid.
        selected_index: (T, k) int64 experts chosen by top-k before capacity and padding
            (the same tensor as ``top_k_index`` when nothing was masked); routing replay uses it.
        dropped_pairs: 0-dim int64 count of (token, slot) pairs dropped by capacity, or None
            when routing is dropless.
    """

    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor
    tokens_per_expert: torch.Tensor
    valid_mask: torch.Tensor | None = None
    selected_index: torch.Tensor = None  # type: ignore[assignment]  # set in __post_init__
    dropped_pairs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Default ``selected_index`` to ``top_k_index``."""
        if self.selected_index is None:
            object.__setattr__(self, "selected_index", self.top_k_index)

    @property
    def num_experts(self) -> int:
        """E, the number of routed experts."""
        return int(self.logits.shape[-1])

    @property
    def top_k(self) -> int:
        """k, experts per token."""
        return int(self.top_k_index.shape[-1])


DEFAULT_OPTIONS = RouteOptions()


def _check_config_options(options: RouteOptions, top_k: int, score_func: str,
                          renormalize: bool) -> None:
    """``options`` is a RouteOptions; a MoEConfig (one) must agree with route's own arguments."""
    if not isinstance(options, RouteOptions):
        raise TypeError(f"options must be a RouteOptions or a MoEConfig, got "
                        f"{type(options).__name__} {options!r}")
    if not isinstance(options, MoEConfig):
        return
    given = {"top_k": top_k, "score_func": score_func, "renormalize": renormalize}
    differ = [f"{name}={getattr(options, name)!r} but route got {name}={value!r}"
              for name, value in given.items() if getattr(options, name) != value]
    if differ:
        raise ValueError(f"options is a MoEConfig with {'; '.join(differ)}: route uses only "
                         "its routing options (groups, scaling, capacity); pass the config's "
                         "top_k, score_func and renormalize too, or a RouteOptions")


def _check_route_args(logits_TE: torch.Tensor, top_k: int, score_func: str,
                      selection_bias_E: torch.Tensor | None,
                      valid_mask_T: torch.Tensor | None) -> torch.Tensor | None:
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be (T, E), got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, num_experts={E}], got {top_k}")
    score_function(score_func)  # ValueError naming the known score functions
    if selection_bias_E is not None and selection_bias_E.shape != (E,):
        raise ValueError(f"selection_bias must be (E,) with E={E}, "
                         f"got {tuple(selection_bias_E.shape)}")
    return check_token_mask(valid_mask_T, T)


def _select(logits_TE: torch.Tensor, scores_TE: torch.Tensor, top_k: int,
            selection_bias_E: torch.Tensor | None, options: RouteOptions) -> torch.Tensor:
    """(T, k) int64 selected experts: biased scores, group limit, top-k (lowest index on ties)."""
    # Every score function is monotone in each logit: without a bias or groups, rank by logit,
    # which stays ordered where the scores underflow to 0. Group scores are sums of scores and a
    # bias is added to scores, so those rank on the scores.
    select_TE = scores_TE.detach()
    if selection_bias_E is not None:
        select_TE = select_TE + selection_bias_E.to(select_TE.dtype)
        if options.n_group == 1:  # a zero bias ranks by logit; chosen on device, no host read
            select_TE = torch.where(selection_bias_E.any(), select_TE, logits_TE.detach())
    elif options.n_group == 1:
        select_TE = logits_TE.detach()
    select_TE = group_limited_scores(select_TE, options.n_group, options.topk_group)
    return top_k_lowest_index(select_TE, top_k)


def _replayed_selection(replay: RoutingResult, T: int, top_k: int) -> torch.Tensor:
    """(T, k) int64 selection of a replayed result; ValueError when its shape differs."""
    if replay.selected_index.shape != (T, top_k):
        raise ValueError(f"replay must route (T, k)=({T}, {top_k}) pairs, got "
                         f"{tuple(replay.selected_index.shape)}")
    return replay.selected_index


def _weights(logits_TE: torch.Tensor, scores_TE: torch.Tensor, index_TK: torch.Tensor,
             score_func: str, renormalize: bool, scale: float) -> torch.Tensor:
    """(T, k) fp32 routing weights of the selected experts (differentiable w.r.t. the logits)."""
    weights_TK = scores_TE.gather(1, index_TK)
    if renormalize:  # s_j / Σ s over the k selected, as the score function's table entry says
        weights_TK = SCORE_FUNCTIONS[score_func].renormalized(logits_TE.gather(1, index_TK),
                                                              weights_TK)
    return weights_TK * scale if scale != 1.0 else weights_TK


def _kept_pairs(selected_TK: torch.Tensor, weights_TK: torch.Tensor, E: int,
                valid_mask_T: torch.Tensor | None, options: RouteOptions,
                replay: RoutingResult | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(T, k) bool mask of dispatched pairs (None: all) and the count dropped by capacity."""
    T, K = selected_TK.shape
    if replay is not None:  # the forward's drops and padding, as decided then
        if replay.top_k_index is replay.selected_index:
            return None, None
        return replay.top_k_index < E, None
    valid_TK = None if valid_mask_T is None else valid_mask_T[:, None].expand(T, K)
    if options.capacity_factor is None:
        return valid_TK, None
    capacity = expert_capacity(T, E, K, options.capacity_factor, options.min_capacity)
    ids_TK = selected_TK if valid_TK is None else torch.where(valid_TK, selected_TK, E)
    keep_TK = capacity_keep_mask(ids_TK, weights_TK, E, capacity, options.drop_policy)
    return keep_TK, ids_TK.lt(E).sum() - keep_TK.sum()


@fp32_routing
def route(logits_TE: torch.Tensor, top_k: int, *, score_func: ScoreFunc = "softmax",
          renormalize: bool = True, selection_bias_E: torch.Tensor | None = None,
          valid_mask_T: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
          options: RouteOptions = DEFAULT_OPTIONS,
          replay: RoutingResult | None = None) -> RoutingResult:
    """Select k experts per token from router logits, in fp32.

    Order: scores (softmax over E, or sigmoid) → selection scores (scores + selection bias;
    without groups and with no or an all-zero bias the logits: the same order, kept where
    scores underflow to equal values; the zero test runs on the device, no host read) → group
    limit → top-k, ties to the lower expert index → weights from the unbiased scores,
    renormalised → × routed scaling factor → capacity (dropped pairs become the sentinel E with
    weight 0, chosen by selection) → padding.

    Args:
        logits_TE: (T, E) router logits, any float dtype (upcast to fp32 here; float64 stays).
        top_k: k in [1, E].
        score_func: a name in :data:`memfine.routing.scores.SCORE_FUNCTIONS` (``softmax``
            over E; elementwise ``sigmoid`` or ``sqrtsoftplus``).
        renormalize: divide the k selected scores by their sum (elementwise scores: as a
            softmax of their logs over the k, so weights stay finite and sum to 1 when the
            scores underflow).
        selection_bias_E: optional (E,) fp32 bias added to the scores for top-k selection only
            (aux-loss-free balancing, or a skew knob for experiments); weights use unbiased scores.
        valid_mask_T: optional (T,) bool or integer mask (nonzero = a real token, e.g. an
            int64 0/1 attention mask; float masks raise); padding tokens get the sentinel
            expert id E, weight 0, and are left out of ``tokens_per_expert``.
        out_dtype: dtype of ``top_k_weights`` (default: the dtype of ``logits_TE``).
        options: group limit, scaling factor and capacity: a :class:`RouteOptions`, or the
            layer's :class:`memfine.config.MoEConfig` (which inherits those fields; its
            ``top_k``, ``score_func`` and ``renormalize`` must then equal the arguments).
        replay: a previous result for the same tokens: its selection and drops are reused and
            only the weights are recomputed from these logits (routing replay in a recompute).

    Returns a :class:`RoutingResult`. Raises ValueError if logits are not 2-D, top_k is out of
    range, score_func is unknown, the mask/bias or replay shapes do not match, or a MoEConfig
    given as ``options`` disagrees with ``top_k``, ``score_func`` or ``renormalize``;
    TypeError if ``options`` is neither. Reference: docs/design.md §2; DeepSeek-V3 §2.1.2
    (bias, groups, scaling); GShard §2.2 (capacity).
    """
    valid_mask_T = _check_route_args(logits_TE, top_k, score_func, selection_bias_E, valid_mask_T)
    _check_config_options(options, top_k, score_func, renormalize)
    T, E = logits_TE.shape
    out_dtype = out_dtype or logits_TE.dtype
    logits_TE = logits_TE.to(router_dtype(logits_TE.dtype))
    scores_TE = SCORE_FUNCTIONS[score_func].scores(logits_TE)
    selected_TK = (_select(logits_TE, scores_TE, top_k, selection_bias_E, options)
                   if replay is None else _replayed_selection(replay, T, top_k))
    weights_TK = _weights(logits_TE, scores_TE, selected_TK, score_func, renormalize,
                          options.routed_scaling_factor)
    keep_TK, dropped = _kept_pairs(selected_TK, weights_TK, E, valid_mask_T, options, replay)
    top_k_index_TK = selected_TK
    if keep_TK is not None:
        top_k_index_TK = torch.where(keep_TK, selected_TK, E)
        weights_TK = torch.where(keep_TK, weights_TK, 0.0)
    counts = count_per_expert(top_k_index_TK, E)
    return RoutingResult(top_k_index=top_k_index_TK, top_k_weights=weights_TK.to(out_dtype),
                         logits=logits_TE, scores=scores_TE, tokens_per_expert=counts,
                         valid_mask=valid_mask_T, selected_index=selected_TK,
                         dropped_pairs=dropped)


class TopKRouter(FP32BuffersMixin):
    """Linear router x·W_rᵀ computed in fp32, followed by :func:`route`.

    Everything runs in fp32 with autocast disabled (:func:`fp32_routing`), also inside a
    ``torch.autocast`` region; the selection bias stays an fp32 buffer through
    ``module.to(dtype)`` (:class:`FP32BuffersMixin`).

    Args:
        hidden_size: d.
        num_experts: E.
        top_k: k.
        score_func: a name in :data:`memfine.routing.scores.SCORE_FUNCTIONS`.
        renormalize: renormalise the k selected weights.
        options: group limit, scaling and capacity: a :class:`RouteOptions` or the layer's
            :class:`memfine.config.MoEConfig`.
        jitter_eps: ε of Switch Transformer's input jitter (training mode only): the router's
            input is multiplied by U(1−ε, 1+ε); the caller's tensor is not changed.

    Attributes:
        weight: (E, d) parameter (kept in the module dtype; upcast to fp32 for the logits).
        selection_bias: (E,) fp32 buffer added to scores for selection only (zeros by default).
        replay: the :class:`memfine.routing.replay.RoutingReplay` of this router.

    Side effects: a grad-enabled forward records its selection for routing replay; a forward
    inside a backward pass (a user's activation-checkpoint recompute) replays it (eager only;
    skipped while ``torch.compile`` traces, see docs/compile.md).

    Reference: docs/design.md §2; Switch Transformer §2.4 (jitter).
    """

    selection_bias: torch.Tensor  # a registered buffer

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 score_func: ScoreFunc = "softmax", renormalize: bool = True,
                 options: RouteOptions = DEFAULT_OPTIONS, jitter_eps: float = 0.0) -> None:
        """Create the weight (N(0, 0.02²)) and a zero selection bias; arguments as on the class.

        Raises:
            ValueError: if ``top_k`` is not in [1, num_experts] or ``jitter_eps`` not in [0, 1).
        """
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if not 0 <= jitter_eps < 1:
            raise ValueError(f"jitter_eps must be in [0, 1), got {jitter_eps}")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize = score_func, renormalize
        self.options, self.jitter_eps = options, jitter_eps
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("selection_bias", torch.zeros(num_experts), persistent=True)
        from memfine.routing.replay import RoutingReplay

        self.replay = RoutingReplay()
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
            valid_mask_T: optional (T,) bool or integer mask (as :func:`route`); False / 0
                marks padding tokens.

        Returns:
            A :class:`RoutingResult`; ``top_k_weights`` in ``x_TD.dtype``.

        Raises:
            RuntimeError: inside a backward pass with no recorded forward decision (see
                :meth:`memfine.routing.replay.RoutingReplay.take`).
        """
        from memfine.routing.replay import in_backward

        # Replay's Python state and graph-task query are not traceable: eager only
        # (docs/compile.md, "Routing options and routing replay").
        tracked = not torch.compiler.is_compiling()
        replay = self.replay.take(x_TD.shape[0]) if tracked and in_backward() else None
        result = self.decide(x_TD, valid_mask_T, replay,
                             jitter=self.training and self.jitter_eps > 0)
        if tracked and replay is None and result.top_k_weights.requires_grad:
            result = dataclasses.replace(result,
                                         top_k_weights=self.replay.record(result))
        return result

    @fp32_routing
    def decide(self, x_TD: torch.Tensor, valid_mask_T: torch.Tensor | None = None,
               replay: RoutingResult | None = None, *, jitter: bool = False) -> RoutingResult:
        """Logits x·W_rᵀ in fp32 and :func:`route`, without the replay bookkeeping of forward.

        Args:
            x_TD: (T, d) activations, any float dtype.
            valid_mask_T: optional (T,) bool or integer mask (as :func:`route`); False / 0
                marks padding tokens.
            replay: a previous decision to reuse (see :func:`route`).
            jitter: multiply the router input by U(1−ε, 1+ε) first (training).

        Returns:
            A :class:`RoutingResult`; ``top_k_weights`` in ``x_TD.dtype``. The fp32 copies of x
            and W are dropped as soon as the logits exist (kept only by a graph that saves
            them).
        """
        dtype = router_dtype(x_TD.dtype)
        x_in = x_TD.to(dtype)
        if jitter:
            noise_TD = torch.empty_like(x_in).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps)
            x_in = x_in * noise_TD
            del noise_TD
        logits_TE = F.linear(x_in, self.weight.to(dtype))
        del x_in
        return route(logits_TE, self.top_k, score_func=self.score_func,
                     renormalize=self.renormalize,
                     selection_bias_E=self.selection_bias,  # a zero bias selects as none
                     valid_mask_T=valid_mask_T, out_dtype=x_TD.dtype, options=self.options,
                     replay=replay)
