"""Allocation timeline of one MoE layer call whose routed experts run expert-parallel.

Mirrors :meth:`memfine.parallel.ExpertParallelExperts.run` on one rank: the frozen dispatch
plan of every chunk (:func:`memfine.parallel.notify.plan_chunks`: a send index over the E
global experts and a receive index over the L local experts, both kept to the end of backward),
then per chunk :func:`memfine.parallel.experts.ep_chunk_forward` (the sent copy x_MD and its
weights, the received rows x_SD and w_S, the fused experts on the S received rows over L
experts, the returned rows y_MD and the combine's (C, k, d) gather) and, in backward, the
combine's and the all-to-alls' gradient rows (dY_MD, dY_SD, dx_SD, dw_M, dx_MD) around the fused
backward. With ``router`` the router node's forward and backward frame the experts as in
:func:`memfine.layer_timeline.layer.simulate_layer` (an :class:`memfine.nn.MoELayer` call);
without it the timeline is the experts' call alone (what ``run`` allocates).

Not modelled: the count exchange's transients (a few T·k int64 per candidate c, before the plan
exists), the agreement's two int64, and the late free of an all-to-all's tensors when gloo drops
its reference from its own thread after the call returned (the policy adds one such buffer).
The live-storage tracker's out-of-place ``index_add_`` in ``index_select``'s backward is
modelled (one (C, k) buffer more than the program). Empty chunks (c > T, or s″ = 0) run too:
every chunk's all-to-alls are collectives.

Legend: T tokens, C tokens of a chunk, K = k, E experts (global), L experts on this rank, M rows
a chunk sends (≤ C·k), S rows it receives, D = d, D_t activation bytes.
Reference: our derivation from the code (docs/design.md §4, §5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from memfine.config import MoEConfig, config_block_rows
from memfine.layer_timeline.router import node_backward, node_forward
from memfine.timeline.base import Shape, Timeline, cat_chunks
from memfine.timeline.experts import index_forward
from memfine.timeline.fused import fused_backward, fused_forward


def _slot_rows(tl: Timeline, C: int, K: int, row_bytes: int, name: str) -> str:
    """ops.combine.reduce_rows: valid mask, clamp, int64 map, (C, k, d) gather; the (C, d) sum."""
    valid = tl.alloc(f"{name}.valid", C * K)
    clamp = tl.alloc(f"{name}.clamp", C * K * 4)
    idx = tl.alloc(f"{name}.idx64", C * K * 8)
    tl.free(clamp)
    rows = tl.alloc(f"{name}.rows_CKD", C * K * row_bytes)
    tl.free(tl.alloc(f"{name}.not_valid", C * K), valid, idx)
    out = tl.alloc(f"{name}.sum", C * row_bytes)
    tl.free(rows)
    return out


def _chunk_forward(tl: Timeline, s: Shape, loc: Shape, C: int, M: int, S: int, *,
                   keep: bool, rerun: bool) -> tuple[list[str], str | None]:
    """ep_chunk_forward: dispatch, two all-to-alls, fused experts, all-to-all back, combine.

    ``keep``: the saved tensors stay (no checkpoint, or its recomputation); returns them
    (the fused path's H blocks, x_SD, w_S and index_select's int64 slots) and the chunk output
    (None for a recomputation, which stops after the combine's forward).
    """
    row = s.moe.hidden_size * s.dt
    eti = tl.alloc("ep.eti64", M * 8)  # gather_rows' int64 index
    x_md = tl.alloc("ep.x_MD", M * row)
    tl.free(eti)
    slots = tl.alloc("ep.esi64", M * 8)  # index_select saves its int64 index
    w_m = tl.alloc("ep.w_M", M * s.dt)
    saved = [slots] if keep else []
    if not keep:
        tl.free(slots)
    x_sd, w_s = tl.alloc("ep.x_SD", S * row), tl.alloc("ep.w_S", S * s.dt)
    tl.free(x_md, w_m)
    hs, y_sd = fused_forward(tl, loc, S, S)
    y_md = tl.alloc("ep.y_MD", M * row)
    out = _slot_rows(tl, C, s.moe.top_k, row, "ep.combine")
    if keep:
        saved += [*hs, x_sd, w_s]
    else:
        tl.free(*hs, x_sd, w_s)
    tl.free(y_sd, y_md)
    if rerun:
        tl.free(out)
        return saved, None
    return saved, out


def _chunk_backward(tl: Timeline, s: Shape, loc: Shape, C: int, M: int, S: int,
                    saved: list[str], shared: dict[str, str] | None) -> dict[str, str]:
    """One chunk's backward in the engine's order; frees ``saved``.

    The combine, the returned rows' all-to-all, the fused experts, the weights' all-to-all and
    index_select, the rows' all-to-all and the dispatch.
    """
    row, K = s.moe.hidden_size * s.dt, s.moe.top_k
    slots, fused_saved = saved[0], saved[1:]
    eti = tl.alloc("ep.bwd.eti64", M * 8)
    dy_md = tl.alloc("ep.bwd.dY_MD", M * row)
    tl.free(eti)
    dy_sd = tl.alloc("ep.bwd.dY_SD", S * row)
    tl.free(dy_md)
    grads = fused_backward(tl, loc, S, S, fused_saved, shared)
    tl.free(dy_sd)
    dw_m = tl.alloc("ep.bwd.dw_M", M * s.dt)
    tl.free(grads.pop("weights"))
    zeros = tl.alloc("ep.bwd.dw_zeros", C * K * s.dt)  # index_select_backward (out of place)
    dw = tl.alloc("ep.bwd.dw_CK", C * K * s.dt)
    tl.free(zeros, dw_m, slots)
    dx_md = tl.alloc("ep.bwd.dx_MD", M * row)
    tl.free(grads.pop("x"))
    grads["x"] = _slot_rows(tl, C, K, row, "ep.bwd.dispatch")
    grads["weights"] = dw
    tl.free(dx_md)
    return grads


def simulate_ep_layer(moe: MoEConfig, num_tokens: int, dtype_bytes: int,
                      chunk_rows: Sequence[tuple[int, int]], *, local_experts: int,
                      recompute: str = "experts", device_type: str = "cpu",
                      block_rows: int | None = None, router: bool = True) -> Timeline:
    """Replay one expert-parallel layer call's forward + backward on one rank.

    Args:
        moe: the layer config (E global; ``experts_impl`` fused).
        num_tokens: T of this rank.
        dtype_bytes: D_t.
        chunk_rows: per chunk, in token order, (M rows sent, S rows received); c = its length.
        local_experts: L = E / ep.
        recompute: ``none``, ``experts`` or ``full``.
        device_type: the activations' device.
        block_rows: rows per fused row block (None: the config's own).
        router: frame the experts with the router node (a layer call); False: the experts'
            ``run`` alone.

    Returns:
        The :class:`Timeline` (``peak``, ``phase_peaks``: ``forward``, ``end``).
    """
    rows = config_block_rows(moe, dtype_bytes, device_type) if block_rows is None else block_rows
    T, c, D, K, dt = num_tokens, len(chunk_rows), moe.hidden_size, moe.top_k, dtype_bytes
    s = Shape(moe, T, dt, device_type, block_rows=rows)
    loc = Shape(dataclasses.replace(moe, num_experts=local_experts, top_k=1,
                                    renormalize=False), T, dt, device_type,
                block_rows=rows)
    ckpt = recompute != "none"
    tl = Timeline(record=False)
    rt = node_forward(tl, s) if router else {}
    sizes = [(T + c - 1 - i) // c for i in range(c)]
    local_ids = tl.alloc("plan.local_ids", moe.num_experts * 8)  # (ep·L,) int64 local ids
    for C, (M, S) in zip(sizes, chunk_rows, strict=True):
        index_forward(tl, s, C, M)
        repeated = tl.alloc("plan.local_S1", S * 8)
        index_forward(tl, loc, S, S)
        tl.free(repeated)
    tl.free(local_ids)
    chunk_saved, outs = [], []
    for C, (M, S) in zip(sizes, chunk_rows, strict=True):
        saved, out = _chunk_forward(tl, s, loc, C, M, S, keep=not ckpt, rerun=False)
        chunk_saved.append(saved)
        outs.append(out)
    out = cat_chunks(tl, [o for o in outs if o], "fwd.out_cat", T * D * dt)
    tl.mark("forward")  # the caller keeps out through backward
    shared: dict[str, str] | None = {} if c > 1 else None
    grads_w, grads_x = [], []
    for i in reversed(range(c)):
        C, (M, S) = sizes[i], chunk_rows[i]
        saved = chunk_saved[i]
        if ckpt:
            saved, _ = _chunk_forward(tl, s, loc, C, M, S, keep=True, rerun=True)
        grads = _chunk_backward(tl, s, loc, C, M, S, saved, shared)
        if i == 0 and rt:
            tl.free(rt["weights"])
        grads_w.append(grads.pop("weights"))
        grads_x.append(grads.pop("x"))  # the weight gradients in grads stay to the end
    grad_w = cat_chunks(tl, grads_w, "grad.top_k_weights_cat", T * K * dt)
    grad_x = cat_chunks(tl, grads_x, "grad.x_cat", T * D * dt)
    if rt:
        node_backward(tl, s, rt, grad_w, grad_x)
    tl.mark("end")
    return tl
