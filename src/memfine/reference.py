"""A deliberately slow per-token, per-slot MoE loop: the semantics every fast path must match.

Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n or n.
Runs in any dtype (float64 for gradient references), on CPU, with autograd. Nobody optimises it;
nothing below the CLI imports it, so fast paths are never tested against themselves.
Reference: docs/design.md §1-§2 (semantics), docs/style.md §6.
"""

from __future__ import annotations

import math

import torch

from memfine.config import GatedActivation


def _silu(v: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return v / (1 + torch.exp(-alpha * v))


def _gelu(v: torch.Tensor) -> torch.Tensor:  # tanh approximation
    return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def _relu(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v > 0, v, torch.zeros_like(v))


def _gated(h: torch.Tensor, spec: GatedActivation) -> torch.Tensor:
    """A = f_α(min(gate, L)) · (clamp(up, -L, L) + offset), one row, written out by element."""
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
    glu = _silu(gate, spec.alpha) if spec.gate_fn == "silu" else _gelu(gate)
    return glu * (up + spec.up_offset)


def _act(h: torch.Tensor, activation: str | GatedActivation) -> torch.Tensor:
    """Activations written out from their formulas (independent of torch.nn.functional)."""
    if isinstance(activation, GatedActivation):
        return _gated(h, activation)
    if activation in ("swiglu", "geglu"):
        return _gated(h, GatedActivation(gate_fn="silu" if activation == "swiglu" else "gelu"))
    return {"silu": _silu, "gelu": _gelu, "relu": _relu}[activation](h)


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
        activation: as in :func:`memfine.ops.run_experts` (a name or a ``GatedActivation``).
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


def reference_route(x_TD: torch.Tensor, router_weight_ED: torch.Tensor, top_k: int,
                    score_func: str = "softmax", renormalize: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token routing: logits, scores, top-k by a Python sort.

    Returns:
        ``(top_k_index (T,k) int64, top_k_weights (T,k), logits (T,E))`` in the router's compute
        dtype (fp32 for fp32/bf16 inputs, float64 for float64 inputs).
    """
    dtype = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
    logits = x_TD.to(dtype) @ router_weight_ED.to(dtype).t()
    idx_rows, w_rows = [], []
    for t in range(x_TD.shape[0]):
        z = logits[t]
        if score_func == "softmax":
            ex = torch.exp(z - z.max())
            s = ex / ex.sum()
        else:
            s = 1 / (1 + torch.exp(-z))
        order = sorted(range(len(s)), key=lambda e: (-float(s[e].detach()), e))[:top_k]
        w = torch.stack([s[e] for e in order])
        if renormalize:
            w = w / w.sum()
        idx_rows.append(order)
        w_rows.append(w)
    k_idx = torch.tensor(idx_rows, dtype=torch.int64).reshape(-1, top_k)
    weights = torch.stack(w_rows) if w_rows else logits.new_zeros(0, top_k)
    return k_idx, weights, logits


def reference_moe(x_TD: torch.Tensor, router_weight_ED: torch.Tensor, w_up_EDG: torch.Tensor,
                  w_down_END: torch.Tensor, top_k: int, *, score_func: str = "softmax",
                  renormalize: bool = True, activation: str = "swiglu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route and run the experts token by token.

    Returns:
        ``(out (T,d), top_k_index (T,k), logits (T,E))``; out is differentiable w.r.t. x, the router
        weight and both expert weights.
    """
    k_idx, weights, logits = reference_route(x_TD, router_weight_ED, top_k, score_func,
                                             renormalize)
    out = reference_experts(x_TD, k_idx, weights, w_up_EDG, w_down_END, activation)
    return out, k_idx, logits
