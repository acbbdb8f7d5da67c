"""Allocation timeline of one MoELayer forward + backward: the layer driver.

The expert path (index builders, fused/plain paths, gradient buffers) is in
:mod:`memfine.timeline.experts`, the router node (router and aux losses) in
:mod:`memfine.layer_timeline.router`; this module puts them in the order in which forward and
the autograd engine run them: the router node's forward, the experts, the shared experts; in
backward the experts, then the router node (its recompute and backward) and x's gradient sum.

Legend: T tokens, K = k, E experts, D = d, D_t activation bytes, R router bytes.
Reference: our derivation from the code (docs/design.md §2, §5).
"""

from __future__ import annotations

from memfine.config import MoEConfig, config_block_rows, shared_block_rows
from memfine.config.lora import LoRAConfig
from memfine.layer_timeline.router import node_backward, node_forward
from memfine.layer_timeline.shared import shared_backward, shared_forward
from memfine.timeline.base import cat_chunks, engine_sum
from memfine.timeline.experts import (
    Shape,
    Timeline,
    WeightGrads,
    chunk_tokens,
    chunks_backward,
    experts_forward,
    plain_backward,
)
from memfine.timeline.fused import fused_backward
from memfine.timeline.lora import LoRAShape

__all__ = ["Shape", "Timeline", "WeightGrads", "chunk_tokens", "experts_forward",
           "fused_backward", "plain_backward", "simulate_layer"]


def simulate_layer(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *, num_chunks: int = 1,
                   recompute: str = "none", record: bool = True,
                   keep_aux: bool = True, lora: LoRAConfig | None = None,
                   device_type: str = "cpu", block_rows: int | None = None) -> Timeline:
    """Replay one MoELayer forward + backward (loss gradients given from outside).

    Protocol (what the measurement does): x (T, d) requires grad and exists before; parameters
    have no ``.grad``; the caller keeps out and MoEAux (``keep_aux=False``: only out and the two
    losses); backward runs from out and the two losses with gradients that exist before.
    The timeline marks ``forward`` at the end of forward. ``lora``: the routed experts carry
    split-LoRA adapters on a frozen base (:class:`memfine.nn.lora.LoRAGroupedExperts`), the
    router frozen unless ``lora.train_router`` and the shared experts unless
    ``lora.train_attention`` (:mod:`memfine.timeline.lora`). ``device_type``: the
    activations' device (:class:`memfine.timeline.base.Shape`). ``block_rows``: the routed
    experts' rows per fused row block in the call (None: the config's own,
    :func:`memfine.config.config_block_rows`; the shared experts' follow from it,
    :func:`memfine.config.shared_block_rows`).
    """
    rows = config_block_rows(moe, dtype_bytes, device_type) if block_rows is None else block_rows
    s = Shape(moe, num_tokens, dtype_bytes, device_type, block_rows=rows) if lora is None else \
        LoRAShape(moe, num_tokens, dtype_bytes, device_type, lora=lora, block_rows=rows)
    T, D, K, dt = s.T, moe.hidden_size, moe.top_k, s.dt
    plain, ckpt = moe.experts_impl == "plain", recompute != "none"
    tl = Timeline(record=record)
    rt = node_forward(tl, s)  # the router node: router and losses, (T, E) tensors freed
    sizes = chunk_tokens(T, num_chunks)
    chunk_saved, outs = [], []
    for C in sizes:
        saved, out = experts_forward(tl, s, C, C * K, plain=plain, recompute=ckpt)
        chunk_saved.append(saved)
        outs.append(out)
    out = outs[0]
    if len(outs) > 1:
        out = tl.alloc("fwd.out_cat", T * D * dt)
        tl.free(*outs)
    shared = None
    if moe.num_shared_experts:
        shared, _ = shared_forward(tl, moe, T, dt, sizes, ckpt=ckpt, routed_out=out,
                                   device_type=device_type, block_rows=shared_block_rows(
                                       moe, rows, dtype_bytes, device_type),
                                   frozen=lora is not None and not lora.train_attention)
    weights_held = ckpt or not plain  # the plain path saves w_TK (a masked copy) instead
    if not weights_held:
        tl.free(rt["weights"])
    if not keep_aux:  # the caller drops MoEAux (tokens_per_expert) after forward
        tl.free(rt["counts"])
    tl.mark("forward")
    tl.mark("losses_backward")  # the losses' backward runs inside the router node's
    shared_dx = None if shared is None else shared_backward(tl, moe, shared, ckpt=ckpt)
    grads_w, grads_x = chunks_backward(
        tl, s, sizes, chunk_saved, ckpt=ckpt,
        after_first_chunk=(lambda: tl.free(rt["weights"])) if weights_held else None)
    # SplitWithSizesBackward: one cat per input, and no split (nor cat) with one chunk
    grad_w = cat_chunks(tl, grads_w, "grad.top_k_weights_cat", T * K * dt)
    grad_x = cat_chunks(tl, grads_x, "grad.x_cat", T * D * dt)
    if shared_dx is not None:  # the engine adds the routed experts' dx into the shared ones'
        grad_x = engine_sum(tl, shared_dx, grad_x)
    node_backward(tl, s, rt, grad_w, grad_x)
    tl.mark("end")
    return tl
