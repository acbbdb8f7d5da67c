"""A deliberately slow per-token, per-slot MoE loop: the semantics every fast path must match.

Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n or n.
Runs in any dtype (float64 for gradient references), on CPU, with autograd. Nobody optimises it;
nothing below the CLI imports it, so fast paths are never tested against themselves.
Reference: docs/design.md §1-§2 (semantics), docs/style.md §6.
"""

from __future__ import annotations

import math
from typing import Any, get_args

import torch

from memfine.config import Activation as ActivationName
from memfine.config import GatedActivation, GateFn


def _silu(v: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return v / (1 + torch.exp(-alpha * v))


def _gelu(v: torch.Tensor) -> torch.Tensor:  # tanh approximation
    return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def _relu(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v > 0, v, torch.zeros_like(v))


REFERENCE_GATES = {"silu": _silu, "gelu": lambda v, alpha: _gelu(v)}
"""f_α(gate) per ``GatedActivation.gate_fn``, written out independently of
``memfine.activations.GATE_FUNCTIONS`` (gelu takes α = 1 only)."""


def _gated(h: torch.Tensor, spec: GatedActivation) -> torch.Tensor:
    """A = f_α(min(gate, L)) · (clamp(up, -L, L) + offset), one row, written out by element."""
    if spec.gate_fn not in REFERENCE_GATES:
        raise ValueError(f"the reference has no formula for GatedActivation.gate_fn="
                         f"{spec.gate_fn!r} (REFERENCE_GATES: {sorted(REFERENCE_GATES)})")
    n = h.shape[-1] // 2
    if spec.interleaved:
        gate = torch.stack([h[..., 2 * i] for i in range(n)], -1) if n else h[..., :0]
        up = torch.stack([h[..., 2 * i + 1] for i in range(n)], -1) if n else h[..., :0]
    else:
        gate, up = h[..., :n], h[..., n:]
    if spec.limit is not None:
        gate = torch.where(gate > spec.limit, torch.full_like(gate, spec.limit), gate)
        up = torch.where(up > spec.limit, torch.full_like(up, spec.limit), up)
        up = torch.where(up < -spec.limit, torch.full_like(up, -spec.limit), up)
    return REFERENCE_GATES[spec.gate_fn](gate, spec.alpha) * (up + spec.up_offset)


REFERENCE_ACTIVATIONS: dict[str, Any] = {
    "swiglu": lambda h: _gated(h, GatedActivation(gate_fn="silu")),
    "geglu": lambda h: _gated(h, GatedActivation(gate_fn="gelu")),
    "silu": _silu,
    "gelu": _gelu,
    "relu": _relu,
    "relu2": lambda h: _relu(h) * _relu(h),
}
"""Every named activation written out from its formula (independent of
``memfine.activations.ACTIVATIONS``)."""

for _names, _table, _what in ((get_args(ActivationName), REFERENCE_ACTIVATIONS,
                               "REFERENCE_ACTIVATIONS"),
                              (get_args(GateFn), REFERENCE_GATES, "REFERENCE_GATES")):
    if set(_names) != set(_table):  # a half-added activation, caught at import
        raise ImportError(f"memfine.reference.{_what} {sorted(_table)} must list the config's "
                          f"names {sorted(_names)}")


def _act(h: torch.Tensor, activation: str | GatedActivation) -> torch.Tensor:
    """Activations written out from their formulas (independent of torch.nn.functional).

    Raises:
        ValueError: for a name without a formula here (never a silent substitute).
    """
    if isinstance(activation, GatedActivation):
        return _gated(h, activation)
    if activation not in REFERENCE_ACTIVATIONS:
        raise ValueError(f"the reference has no formula for activation={activation!r} "
                         f"(REFERENCE_ACTIVATIONS: {sorted(REFERENCE_ACTIVATIONS)})")
    return REFERENCE_ACTIVATIONS[activation](h)


def reference_experts(x_TD: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, w_up_EDG: torch.Tensor,
                      w_down_END: torch.Tensor, activation: str | GatedActivation = "swiglu", *,
                      b_up_EG: torch.Tensor | None = None,
                      b_down_ED: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = Σ_j w[t,j]·(act(x[t]·w_up[e] + b_up[e])·w_down[e] + b_down[e]), slot by slot.

    Args:
        x_TD: (T, d) input.
        top_k_index: (T, k) int expert ids; ids outside [0, E) contribute nothing.
        top_k_weights: (T, k) weights.
        w_up_EDG: (E, d, G) up-projection weights.
        w_down_END: (E, n, d) down-projection weights.
        activation: as in :func:`memfine.experts.run_experts` (a name or a ``GatedActivation``).
        b_up_EG: optional (E, G) up-projection bias.
        b_down_ED: optional (E, d) down-projection bias.

    Returns:
        (T, d) tensor, differentiable w.r.t. every float input; an input no routed row uses
        (an empty expert, T = 0, all-sentinel slots) gets an exactly zero gradient, not None.
    """
    E = w_up_EDG.shape[0]
    rows = []
    for t in range(x_TD.shape[0]):
        acc = x_TD.new_zeros(x_TD.shape[1])
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            if 0 <= e < E:
                h = x_TD[t] @ w_up_EDG[e]
                h = h + b_up_EG[e] if b_up_EG is not None else h
                y = _act(h, activation) @ w_down_END[e]
                y = y + b_down_ED[e] if b_down_ED is not None else y
                acc = acc + top_k_weights[t, j].to(x_TD.dtype) * y
        rows.append(acc)
    out = torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])
    # Empty slices tie every input into the graph (its gradient is then exactly 0, not None, when
    # no routed row uses it) without reading a value (no 0·NaN from padding rows).
    anchor = x_TD[:0].sum()
    for v in (top_k_weights, w_up_EDG, w_down_END, b_up_EG, b_down_ED):
        if v is None:
            continue
        anchor = anchor + v[:0].sum().to(x_TD.dtype)
    return out + anchor


def _log_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """Log σ(z) = min(z, 0) − log(1 + e^−|z|), finite for every finite z."""
    return torch.clamp(z, max=0) - torch.log1p(torch.exp(-z.abs()))


def _softmax_scores(z: torch.Tensor) -> tuple[torch.Tensor, None]:
    ex = torch.exp(z - z.max())
    return ex / ex.sum(), None


def _sigmoid_scores(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return 1 / (1 + torch.exp(-z)), torch.stack([_log_sigmoid(v) for v in z]) if len(z) else z


def _sqrtsoftplus_scores(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    softplus = torch.stack([torch.log1p(torch.exp(v)) if v < 30 else v for v in z]) if len(z) else z
    return torch.sqrt(softplus), 0.5 * torch.log(softplus)


REFERENCE_SCORES = {"softmax": _softmax_scores, "sigmoid": _sigmoid_scores,
                    "sqrtsoftplus": _sqrtsoftplus_scores}
"""One token's (E,) scores and their logs (None: renormalise by plain ratio), per score
function, written out independently of :mod:`memfine.routing.scores`."""


def _token_choice(z: torch.Tensor, s: torch.Tensor, top_k: int,
                  bias: list[float] | None, n_group: int, topk_group: int) -> list[int]:
    """One token's k experts: biased scores, group limit (-inf), lowest index on ties."""
    E = len(s)
    if bias is not None:
        sel = [float(s[e].detach()) + bias[e] for e in range(E)]
    elif n_group == 1:  # softmax and sigmoid are monotone: rank by logit
        sel = [float(z[e].detach()) for e in range(E)]
    else:
        sel = [float(s[e].detach()) for e in range(E)]
    if n_group > 1:
        size = E // n_group
        group_score = [sum(sorted(sel[g * size:(g + 1) * size], reverse=True)[:2])
                       for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        sel = [v if e // size in kept else -math.inf for e, v in enumerate(sel)]
    return sorted(range(E), key=lambda e: (-sel[e], e))[:top_k]


def _drop_over_capacity(idx_rows: list[list[int]], w_rows: list[torch.Tensor], E: int,
                        capacity_factor: float, min_capacity: int, drop_policy: str) -> None:
    """Per expert keep ``capacity`` pairs (highest weight or earliest token); drop the rest."""
    T = len(idx_rows)
    k = len(idx_rows[0]) if T else 0
    capacity = min(T, max(min_capacity, math.ceil(capacity_factor * T * k / E)))
    for e in range(E):
        pairs = [(t, j) for t in range(T) for j in range(k) if idx_rows[t][j] == e]
        if drop_policy == "probs":
            pairs.sort(key=lambda p: (-float(w_rows[p[0]][p[1]].detach()), p[0]))
        for t, j in pairs[capacity:]:
            idx_rows[t][j] = E
            w_rows[t] = torch.where(torch.arange(k) == j, torch.zeros_like(w_rows[t]), w_rows[t])


def reference_route(x_TD: torch.Tensor, router_weight_ED: torch.Tensor, top_k: int,
                    score_func: str = "softmax", renormalize: bool = True, *,
                    selection_bias: torch.Tensor | None = None, n_group: int = 1,
                    topk_group: int = 1, routed_scaling_factor: float = 1.0,
                    capacity_factor: float | None = None, min_capacity: int = 0,
                    drop_policy: str = "probs"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token routing: logits, scores, top-k by a Python sort, then capacity per expert.

    Semantics (as :func:`memfine.routing.route`): selection on scores + bias (without bias and
    groups: on the logits); excluded groups -inf, a group scored by its top-2 sum; ties to the
    lower index; weights from the unbiased scores, renormalised (elementwise scores: ratios of
    exp(log score)),
    times ``routed_scaling_factor``; then each expert keeps ``min(T, max(min_capacity,
    ⌈cf·T·k/E⌉))`` pairs by weight (``probs``) or position, dropped pairs get id E, weight 0.

    Returns:
        ``(top_k_index (T,k) int64, top_k_weights (T,k), logits (T,E))`` in the router's compute
        dtype (fp32 for fp32/bf16 inputs, float64 for float64 inputs).
    """
    dtype = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
    logits = x_TD.to(dtype) @ router_weight_ED.to(dtype).t()
    bias = None if selection_bias is None else [float(b) for b in selection_bias]
    idx_rows, w_rows = [], []
    for t in range(x_TD.shape[0]):
        z = logits[t]
        if score_func not in REFERENCE_SCORES:
            raise ValueError(f"the reference has no formula for score_func={score_func!r}")
        s, log_scores = REFERENCE_SCORES[score_func](z)
        order = _token_choice(z, s, top_k, bias, n_group, topk_group)
        if renormalize and log_scores is not None:
            log_s = torch.stack([log_scores[e] for e in order])
            w = torch.exp(log_s - log_s.max())
            w = w / w.sum()
        else:
            w = torch.stack([s[e] for e in order])
            if renormalize:
                w = w / w.sum()
        idx_rows.append(order)
        w_rows.append(w * routed_scaling_factor)
    if capacity_factor is not None:
        _drop_over_capacity(idx_rows, w_rows, logits.shape[1], capacity_factor, min_capacity,
                            drop_policy)
    k_idx = torch.tensor(idx_rows, dtype=torch.int64).reshape(-1, top_k)
    weights = torch.stack(w_rows) if w_rows else logits.new_zeros(0, top_k)
    return k_idx, weights, logits


def reference_moe(x_TD: torch.Tensor, router_weight_ED: torch.Tensor, w_up_EDG: torch.Tensor,
                  w_down_END: torch.Tensor, top_k: int, *, score_func: str = "softmax",
                  renormalize: bool = True, activation: str = "swiglu",
                  shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
                  **routing: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route and run the experts token by token, plus any shared experts.

    Args:
        x_TD: (T, d) input.
        router_weight_ED: (E, d) router weight.
        w_up_EDG: (E, d, G) routed up-projection.
        w_down_END: (E, n, d) routed down-projection.
        top_k: k.
        score_func: a name in :data:`REFERENCE_SCORES`.
        renormalize: renormalise the k weights.
        activation: as :func:`reference_experts`.
        shared: optional ``(w_up (S,d,G_s), w_down (S,n_s,d), gate (1,d) or None)``: every token
            also gets Σ_s g_t·Expert_s(x_t), g_t = σ(x_t·gate) or 1.
        routing: keyword options of :func:`reference_route` (bias, groups, scaling, capacity).

    Returns:
        ``(out (T,d), top_k_index (T,k), logits (T,E))``; out is differentiable w.r.t. x, the router
        weight and the expert weights.
    """
    k_idx, weights, logits = reference_route(x_TD, router_weight_ED, top_k, score_func,
                                             renormalize, **routing)
    out = reference_experts(x_TD, k_idx, weights, w_up_EDG, w_down_END, activation)
    if shared is not None:
        s_up, s_down, gate = shared
        T, S = x_TD.shape[0], s_up.shape[0]
        g = (torch.ones(T, 1, dtype=x_TD.dtype) if gate is None
             else 1 / (1 + torch.exp(-(x_TD @ gate.to(x_TD.dtype).t()))))
        ids = torch.arange(S).repeat(T, 1)
        out = out + reference_experts(x_TD, ids, g.expand(T, S), s_up, s_down, activation)
    return out, k_idx, logits
