"""Allocation timeline of split LoRA in the fused experts: the adapters' tensors and frozen base.

Mirrors :mod:`memfine.lora.adapters` (``LoRAForward`` / ``LoRABackward``) as ``alloc``/``free``
events, called from the fused path's timeline (:mod:`memfine.timeline.experts`) where
the code calls the adapters, and says what a frozen base changes there: the base weights get no
gradient buffer (no weight-gradient products), only the adapters do.

Per adapter of one fused call (S routed rows, adapted projection d_in → d_out, rank r):
- forward, per row block: U = x·Aᵀ (S·r, saved for backward; with several blocks allocated
  at the first and filled from a B·r transient per block, freed after the product), and the
  product U·Bᵀ (B·d_out, transient, added into H or Y in place);
- backward, per row block of B rows: a copy of B with column-major per-expert matrices
  (E·d_out·r, transient, before P or Q), the rank-r products (B·r), the adapter's term of dA or dx
  (B·n or B·d, transient), the row copies that the adapter gradients read (B·r, and the
  gathered x, B·d, for A_up), and the gradient buffers of A (E·r·d_in) and B (E·d_out·r),
  allocated on first use and handed to autograd at the end (summed over chunks by the engine);
  outside bf16's grouped form B's buffer holds dBᵀ and is handed over as a contiguous copy
  (:func:`hand_over`).

No dropout is modelled (its mask is a transient of the adapter input's size per block).
Legend as :mod:`memfine.timeline.experts`; R = r.
Reference: our derivation from the code (docs/lora.md "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass

from memfine.config.lora import LoRAConfig
from memfine.timeline.base import Shape, Timeline


@dataclass(frozen=True, slots=True)
class LoRAShape(Shape):
    """A :class:`Shape` whose experts' base weights are frozen, with split-LoRA adapters or not.

    Attributes:
        lora: the adapters of the routed experts, or None: frozen experts without adapters
            (the shared experts of a LoRA layer,
            :func:`memfine.layer_timeline.shared.shared_forward`).
    """

    lora: LoRAConfig | None = None


def adapters_of(s: Shape) -> LoRAConfig | None:
    """The adapters of ``s`` (a :class:`LoRAShape`), or None."""
    return getattr(s, "lora", None)


def base_frozen(s: Shape) -> bool:
    """True when the experts' ``w_up``/``w_down`` get no gradient (any :class:`LoRAShape`)."""
    return isinstance(s, LoRAShape)


def router_trained(s: Shape) -> bool:
    """False when the router is frozen (LoRA without ``train_router``): no weight gradient."""
    lora = adapters_of(s)
    return lora is None or lora.train_router


def _sizes(s: Shape) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each adapted projection."""
    moe = s.moe
    out = {"up": (moe.hidden_size, moe.up_width), "down": (moe.intermediate_size,
                                                         moe.hidden_size)}
    lora = adapters_of(s)
    assert lora is not None, "called on a LoRAShape"
    return {k: v for k, v in out.items() if f"w_{k}" in lora.targets}


def forward_term(tl: Timeline, s: Shape, B: int, S: int, which: str, *, first: bool
                 ) -> list[str]:
    """``LoRAForward.up_`` / ``down_`` on a block of B of the call's S rows.

    One block (B = S): U is the block's product (kept). Several: U (S·r) is allocated at the
    first block, and each block's U rows (B·r) are a transient copied in. Then the product
    U·Bᵀ (B·d_out, added in place, freed).

    Returns:
        The saved U when it is allocated here (empty otherwise, and without that adapter).
    """
    lora = adapters_of(s)
    if lora is None or which not in _sizes(s):
        return []
    _, d_out = _sizes(s)[which]
    kept = []
    if B < S and first:
        kept.append(tl.alloc(f"lora.U_{which}", S * lora.rank * s.dt))
    u = tl.alloc(f"lora.U_{which}_block", B * lora.rank * s.dt)
    tl.free(tl.alloc(f"lora.{which}_product", B * d_out * s.dt))
    if B < S:
        tl.free(u)  # the block's rows, freed when the term returns
    else:
        kept.append(u)
    return kept


def _aligned(s: Shape, *widths: int) -> bool:
    """:func:`memfine.ops.weight_grads.uses_grouped_weight_grads` (bf16, 16-byte rows)."""
    return s.dt == 2 and s.moe.gemm_backend != "loop" and all(w * s.dt % 16 == 0
                                                               for w in widths)


def _grad(tl: Timeline, s: Shape, buffers: dict[str, str], name: str, widths: tuple[int, int]
          ) -> None:
    """One block's adapter-gradient product into its buffer (as ``WeightGradBuffers``)."""
    nbytes = s.moe.num_experts * widths[0] * widths[1] * s.dt
    if name not in buffers:
        buffers[name] = tl.alloc(f"grad.{name}", nbytes)
    elif _aligned(s, *widths):
        tl.free(tl.alloc(f"bwd.{name}_block_product", nbytes))


def _times_b(tl: Timeline, s: Shape, B: int, d_out: int, name: str) -> str:
    """``LoRABackward._times_b``: the column-major copy of B (transient), then P or Q (B·r)."""
    lora = adapters_of(s)
    assert lora is not None, "called on a LoRAShape"
    copy = tl.alloc(f"lora.bwd.B_{name}_columns", s.moe.num_experts * d_out * lora.rank * s.dt)
    out = tl.alloc(f"lora.bwd.{name}", B * lora.rank * s.dt)
    tl.free(copy)
    return out


def backward_down(tl: Timeline, s: Shape, B: int, buffers: dict[str, str]) -> None:
    """``LoRABackward.down_block`` for B rows (dA += s·(dO·B)·A; dB_down, dA_down)."""
    lora = adapters_of(s)
    if lora is None or "down" not in _sizes(s):
        return
    R, dt, N, D = lora.rank, s.dt, s.moe.intermediate_size, s.moe.hidden_size
    p = _times_b(tl, s, B, D, "P")
    tl.free(tl.alloc("lora.bwd.dA_term", B * N * dt))
    ws = tl.alloc("lora.bwd.w_times_s", B * dt)
    uw = tl.alloc("lora.bwd.U_down_rows", B * R * dt)
    tl.free(ws)
    _grad(tl, s, buffers, "lora_b_down", (D, R))
    tl.free(uw)
    tl.free(tl.alloc("lora.bwd.w_times_s", B * dt))  # P ⊙= w·s in place
    _grad(tl, s, buffers, "lora_a_down", (R, N))
    tl.free(p)


def backward_up(tl: Timeline, s: Shape, B: int, buffers: dict[str, str], need_x: bool
                ) -> str | None:
    """``LoRABackward.up_block`` for B rows; returns its dx rows (B, d) or None."""
    lora = adapters_of(s)
    if lora is None or "up" not in _sizes(s):
        return None
    R, dt, D, G = lora.rank, s.dt, s.moe.hidden_size, s.moe.up_width
    q = _times_b(tl, s, B, G, "Q")
    us = tl.alloc("lora.bwd.U_up_rows", B * R * dt)
    _grad(tl, s, buffers, "lora_b_up", (G, R))
    tl.free(us)
    x = tl.alloc("lora.bwd.x_BD", B * D * dt)
    _grad(tl, s, buffers, "lora_a_up", (R, D))
    tl.free(x)
    dx = tl.alloc("lora.bwd.dx_BD", B * D * dt) if need_x else None
    tl.free(q)
    return dx


def hand_over(tl: Timeline, s: Shape, buffers: dict[str, str]) -> None:
    """``LoRABackward.take_grads``: each per-expert-``addmm_`` dBᵀ buffer becomes a copy.

    In input order (A_up, B_up, A_down, B_down); a B buffer (E·d_out·r) is copied to dB's own
    layout, then freed; A buffers and bf16's grouped B buffers are handed over as they are.
    """
    lora = adapters_of(s)
    if lora is None:
        return
    for which, (_, d_out) in _sizes(s).items():
        name = f"lora_b_{which}"
        buffer = buffers.get(name)
        if buffer is None or _aligned(s, d_out, lora.rank):
            continue
        buffers[name] = tl.alloc(f"grad.{name}", s.moe.num_experts * d_out * lora.rank * s.dt)
        tl.free(buffer)


def adapter_saved_bytes(lora: LoRAConfig, rows: int, dtype_bytes: int) -> int:
    """Bytes the adapters add to what one fused call of ``rows`` routed rows saves: U per adapter.

    (S·r·D_t per adapted projection; the adapters themselves are parameters.)
    """
    return len(lora.targets) * rows * lora.rank * dtype_bytes
