"""Allocation timeline and saved bytes of an MoE layer's shared experts.

Shared experts run the routed expert path with a fixed routing (every token to all S experts,
weight 1 or a per-token sigmoid gate; :class:`memfine.nn.shared.SharedExperts`), so their
tensors are those of :mod:`memfine.timeline.experts` with k = S and n = n_s, plus the
(S,) expert index, the weights and the sum with the routed output.

Legend: T tokens, C tokens of one chunk, S shared experts, D = d, G_s = 2n_s or n_s, D_t bytes.
Reference: our derivation from the code (docs/design.md §5; DeepSeek-V3 §2.1.2 shared experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfine.config import MoEConfig
from memfine.timeline.base import cat_chunks, engine_sum, expert_saved
from memfine.timeline.experts import (
    Shape,
    Timeline,
    chunks_backward,
    experts_forward,
)
from memfine.timeline.lora import LoRAShape, base_frozen


def shared_saved_items(moe: MoEConfig, chunks: list[int], dt: int, *, ckpt: bool,
                       x_saved: bool) -> dict[str, int]:
    """Saved-for-backward bytes of the shared experts, by :class:`MemoryBreakdown` field.

    Args:
        moe: the layer config (``num_shared_experts`` >= 1).
        chunks: tokens of each chunk (they sum to T).
        dt: D_t.
        ckpt: the expert part is checkpointed (recompute ``experts``/``full``).
        x_saved: the layer input is already counted (the gate's matmul saves it otherwise).

    Returns:
        ``shared_expert_bytes`` (H and index arrays, or the plain path's copies) and
        ``shared_weights_bytes`` (the (T, S) ones or the (T, 1) gate, the (S,) index and, for
        a gate on the plain bf16 path, the layer input).
    """
    sh = moe.shared_experts_config()
    S, T, D = sh.num_experts, sum(chunks), sh.hidden_size
    gate = moe.shared_expert_gate
    weights = T * dt if gate else T * S * dt
    if not gate and moe.experts_impl == "plain" and not ckpt:
        weights = 0  # the plain combine keeps a masked copy of the weights instead
    items = {"shared_weights_bytes": weights + (S * 8 if ckpt else 0),
             "shared_expert_bytes": 0}
    if gate and not x_saved:
        items["shared_weights_bytes"] += T * D * dt
    if ckpt:
        return items
    for C in chunks:
        per_chunk = expert_saved(sh, C, C * S, dt)
        if sh.experts_impl == "plain" and not gate:  # weights need no grad: no slot rows
            per_chunk["combine_copy_bytes"] -= C * S * (D * dt + 1)
        items["shared_expert_bytes"] += sum(per_chunk.values())
    return items


@dataclass(slots=True)
class SharedState:
    """What the shared experts' forward left for backward (timeline names)."""

    shape: Shape
    sizes: list[int]
    index: str
    weights: str
    chunk_saved: list[list[str]] = field(default_factory=list)


def shared_forward(tl: Timeline, moe: MoEConfig, T: int, dt: int, sizes: list[int], *,
                   ckpt: bool, routed_out: str, frozen: bool = False,
                   device_type: str = "cpu", block_rows: int) -> tuple[SharedState, str]:
    """SharedExperts.forward and the sum with the routed output; returns (state, out).

    ``frozen``: the shared experts and their gate are frozen (a LoRA layer without
    ``train_attention``): no weight gradients in backward (:func:`shared_backward`).
    ``block_rows``: the shared experts' rows per fused row block
    (:func:`memfine.config.shared_block_rows`).
    """
    sh = (LoRAShape(moe.shared_experts_config(), T, dt, device_type, block_rows=block_rows)
          if frozen else
          Shape(moe.shared_experts_config(), T, dt, device_type, block_rows=block_rows))
    S, D, plain = sh.moe.num_experts, moe.hidden_size, moe.experts_impl == "plain"
    index = tl.alloc("shared.index", S * 8)
    if moe.shared_expert_gate:
        logits = tl.alloc("shared.gate_logits", T * dt)
        weights = tl.alloc("shared.gate", T * dt)
        tl.free(logits)
    else:
        weights = tl.alloc("shared.ones", T * S * dt)
    state = SharedState(shape=sh, sizes=sizes, index=index, weights=weights)
    outs = []
    for C in sizes:
        saved, out = experts_forward(tl, sh, C, C * S, plain=plain, recompute=ckpt)
        state.chunk_saved.append(saved)
        outs.append(out)
    out = cat_chunks(tl, outs, "shared.out_cat", T * D * dt)
    if not ckpt:
        tl.free(index)
        if not moe.shared_expert_gate and plain:
            tl.free(weights)
    total = tl.alloc("shared.sum", T * D * dt)
    tl.free(routed_out, out)
    return state, total


def shared_backward(tl: Timeline, moe: MoEConfig, state: SharedState, *, ckpt: bool) -> str:
    """Backward of the shared experts (before the routed ones); returns their dx buffer."""
    sh, T, dt = state.shape, state.shape.T, state.shape.dt
    S, D, plain = sh.moe.num_experts, moe.hidden_size, moe.experts_impl == "plain"
    gate = moe.shared_expert_gate
    grads_w, grads_x = chunks_backward(tl, sh, state.sizes, state.chunk_saved, ckpt=ckpt,
                                       need_weights=gate)
    if ckpt:
        tl.free(state.index)
    grad_x = cat_chunks(tl, grads_x, "shared.grad_x_cat", T * D * dt)
    if gate:
        grad_w = cat_chunks(tl, grads_w, "shared.grad_w_cat", T * S * dt)
        summed = tl.alloc("shared.grad_gate_sum", T * dt)
        tl.free(grad_w)
        grad_logits = tl.alloc("shared.grad_gate_logits", T * dt)
        tl.free(summed, state.weights)
        if not base_frozen(sh):  # a frozen gate has no weight gradient
            tl.alloc("grad.shared_gate", D * dt)
        gate_dx = tl.alloc("shared.gate_dx", T * D * dt)
        tl.free(grad_logits)
        grad_x = engine_sum(tl, grad_x, gate_dx)  # the gate's dx, added in place
    elif not plain or ckpt:
        tl.free(state.weights)
    return grad_x
