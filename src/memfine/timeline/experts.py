"""Allocation timeline of memfine's expert path, replayed from the code's own steps.

Each function mirrors one function of memfine (routing-index builders, the fused and plain expert
paths, the chunk loop and the autograd engine's gradient buffers) as a sequence of
``alloc``/``free`` events with byte sizes from the config. The running sum is what torch.profiler's
allocator events show (tensors created inside the measured region); its maximum is the model's
peak. Autograd adds a later gradient of a tensor into the first one in place
(:func:`memfine.timeline.base.engine_sum`), as it does without a dispatch mode.
Integer arithmetic only: nothing is allocated. :mod:`memfine.layer_timeline.layer` adds the
router, the losses and the layer driver.

Legend: C tokens of one chunk, K = k, E experts, D = d, N = n, G = 2n (gated) or n, S routed rows
(S = C·k without sentinels), D_t activation bytes (``dt``), R router bytes (``r``: 4, or 8 for
float64). Sizes of at most 8 bytes (scalars, ``any``/``max`` results) are left out.
Reference: our derivation from the code (docs/design.md §5: peak = saved + largest transient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

from memfine.config import ACTIVATIONS_SAVING_OUTPUT, MoEConfig
from memfine.dispatch.index import sort_free_max_cells
from memfine.timeline.base import Shape, Timeline, WeightGrads
from memfine.timeline.fused import (
    fused_backward,
    fused_forward,
)


def _use_sort_free(moe: MoEConfig, tokens: int, device_type: str) -> bool:
    if moe.index_builder == "auto":
        return tokens * moe.num_experts <= sort_free_max_cells(device_type)
    return moe.index_builder == "sort_free"


def index_forward(tl: Timeline, s: Shape, C: int, S: int) -> dict[str, str]:
    """build_routing_index for C tokens and S rows; returns the five int32 arrays."""
    E, K = s.moe.num_experts, s.moe.top_k
    if _use_sort_free(s.moe, C, s.device_type):
        ge, lt = tl.alloc("idx.ge", C * K), tl.alloc("idx.lt", C * K)
        valid = tl.alloc("idx.valid", C * K)
        tl.free(ge, lt)
        safe = tl.alloc("idx.safe", C * K * 8)
        dense = tl.alloc("idx.dense_map", C * (E + 1) * 8)
        tl.free(tl.alloc("idx.ones", C * K * 8))
        counts = tl.alloc("idx.counts", E * 8)
        offs64 = tl.alloc("idx.offsets64", (E + 1) * 8)
        tl.free(tl.alloc("idx.counts_cumsum", E * 8))
        if C:  # dispatch.index.read_offsets: offsets and the largest cell, one host read
            tl.free(tl.alloc("idx.host_read", (E + 2) * 8))
        cum = tl.alloc("idx.cumsum", C * E * 8)
        one = tl.alloc("idx.one_scalar", 8)  # the wrapped 1 of cumsum - 1
        sub = tl.alloc("idx.cumsum_minus_1", C * E * 8)
        tl.free(one, cum)
        row_te = tl.alloc("idx.row_TE", C * E * 8)
        tl.free(sub)
        clamp = tl.alloc("idx.clamp", C * K * 8)
        gath = tl.alloc("idx.gather", C * K * 8)
        tl.free(clamp)
        row_tk = tl.alloc("idx.row_TK", C * K * 8)
        tl.free(gath)
        sentinel = tl.alloc("idx.sentinel", C * K)
        rank = tl.alloc("idx.sentinel_rank", C * K * 8)
        perm = tl.alloc("idx.perm", C * K * 8)
        tl.free(rank)
        slot = tl.alloc("idx.slot_arange", C * K * 8)
        eslot = tl.alloc("idx.expert_slot64", C * K * 8)  # scattered over all C·k slots
        locals_ = [valid, safe, dense, counts, offs64, row_te, row_tk, sentinel, perm, slot,
                   eslot]
    else:  # argsort builder (auto: C·E above sort_free_max_cells); sort temporaries approximated
        ge, lt = tl.alloc("idx.ge", C * K), tl.alloc("idx.lt", C * K)
        valid = tl.alloc("idx.valid", C * K)
        tl.free(ge, lt)
        key = tl.alloc("idx.key", C * K * 8)
        values = tl.alloc("idx.sort_values", C * K * 8)
        order = tl.alloc("idx.order", C * K * 8)
        tl.free(values)
        shifted = tl.alloc("idx.shifted_ids", C * K * 8)  # count_per_expert
        counts = tl.alloc("idx.counts", (E + 2) * 8)
        tl.free(shifted)
        offs64 = tl.alloc("idx.offsets64", (E + 1) * 8)
        tl.free(tl.alloc("idx.counts_cumsum", E * 8))
        row = tl.alloc("idx.row_of_slot", C * K * 8)
        tl.free(tl.alloc("idx.arange", C * K * 8))
        row_tk = tl.alloc("idx.row_TK", C * K * 8)
        tl.free(row)
        locals_ = [valid, key, counts, offs64, row_tk, order]
    fdiv = tl.alloc("idx.floor_div", S * 8)
    arrays = {"eti": tl.alloc("idx.expert_token_indices", S * 4)}
    tl.free(fdiv)
    arrays["offs"] = tl.alloc("idx.expert_token_offsets", (E + 1) * 4)
    arrays["tei"] = tl.alloc("idx.token_expert_indices", C * K * 4)
    arrays["tim"] = tl.alloc("idx.token_index_map", C * K * 4)
    arrays["esi"] = tl.alloc("idx.expert_slot_indices", S * 4)
    tl.free(*locals_)
    return arrays


def plain_forward(tl: Timeline, s: Shape, C: int, S: int, *, early_stop: bool = False
                  ) -> tuple[list[str], str | None]:
    """experts_plain under autograd; returns (its saved tensors, out).

    With ``early_stop`` (a checkpoint's recomputation) it stops once the last saved tensor
    (the combine weights) exists, as non-reentrant checkpointing does: no product, no output.
    """
    moe, dt = s.moe, s.dt
    D, N, G, K = moe.hidden_size, moe.intermediate_size, moe.up_width, moe.top_k
    saved = [tl.alloc("plain.eti64", S * 8), tl.alloc("plain.x_SD", S * D * dt)]
    h = tl.alloc("plain.H", S * G * dt)
    if moe.gated:
        saved += [tl.alloc("plain.act_gate", S * N * dt)]
    saved += [tl.alloc("plain.A", S * N * dt)]
    if moe.activation not in ACTIVATIONS_SAVING_OUTPUT:  # relu keeps its result A, not H
        saved.append(h)
    y = tl.alloc("plain.Y", S * D * dt)
    valid = tl.alloc("plain.combine.valid", C * K)
    clamp = tl.alloc("plain.combine.clamp", C * K * 4)
    saved.append(tl.alloc("plain.combine.idx64", C * K * 8))
    tl.free(clamp)
    saved.append(tl.alloc("plain.combine.rows_TKD", C * K * D * dt))
    saved.append(tl.alloc("plain.combine.not_valid", C * K))
    tl.free(valid)
    saved.append(tl.alloc("plain.combine.ge", C * K))
    saved.append(tl.alloc("plain.combine.w_TK", C * K * dt))
    if early_stop:
        tl.free(y, *([h] if moe.activation in ACTIVATIONS_SAVING_OUTPUT else []))
        return saved, None
    product = tl.alloc("plain.combine.weighted", C * K * D * dt)
    out = tl.alloc("fwd.out", C * D * dt)
    tl.free(product, y)
    if moe.activation in ACTIVATIONS_SAVING_OUTPUT:
        tl.free(h)
    return saved, out


def plain_backward(tl: Timeline, s: Shape, C: int, S: int, saved: list[str],
                   wg: WeightGrads) -> dict[str, str]:
    """Autograd backward of experts_plain (engine order as measured); returns its gradients."""
    moe, dt = s.moe, s.dt
    D, N, G, E, K = (moe.hidden_size, moe.intermediate_size, moe.up_width, moe.num_experts,
                     moe.top_k)
    named = {name.split("#")[0]: name for name in saved}
    full = tl.alloc("pbwd.d_w_full", C * K * D * dt)
    grad_rows = tl.alloc("pbwd.d_rows", C * K * D * dt)
    grad_w = tl.alloc("pbwd.d_w", C * K * dt)
    tl.free(full, named["plain.combine.w_TK"], named["plain.combine.rows_TKD"])
    grads = {"weights": tl.alloc("grad.top_k_weights", C * K * dt)}
    tl.free(grad_w, named["plain.combine.ge"])
    zeros = tl.alloc("pbwd.copyslices_zeros", C * K * D * dt)
    tl.free(grad_rows)
    base = tl.alloc("pbwd.copyslices_base", C * K * D * dt)
    clone = tl.alloc("pbwd.copyslices_clone", C * K * D * dt)
    tl.free(tl.alloc("pbwd.masked", C * K * D * dt), clone, zeros,
            named["plain.combine.not_valid"])
    # index_select_backward: zeros, then index_add_ into them (in place; a dispatch mode, as
    # the live-storage tracker, makes it out of place: one more buffer)
    grad_y = tl.alloc("pbwd.dY", S * D * dt)
    tl.free(base, named["plain.combine.idx64"])
    grad_a = tl.alloc("pbwd.dA", S * N * dt)
    probe = tl.alloc("pbwd.wgrad_probe", N * D * dt)
    grads["w_down"] = tl.alloc("grad.w_down", E * N * D * dt)
    relu = moe.activation in ACTIVATIONS_SAVING_OUTPUT  # its own node also keeps A (its result)
    tl.free(probe, grad_y, *([] if relu else [named["plain.A"]]))
    wg.add(grads, "w_down")
    if moe.gated:
        g1, g2 = tl.alloc("pbwd.d_act", S * N * dt), tl.alloc("pbwd.d_up", S * N * dt)
        tl.free(grad_a, named["plain.act_gate"])
        act = tl.alloc("pbwd.d_gate", S * N * dt)
        tl.free(g2, named["plain.H"])
        grad_h = tl.alloc("pbwd.dH", S * G * dt)
        tl.free(act, g1)
    else:
        grad_h = tl.alloc("pbwd.dH", S * N * dt)
        tl.free(named["plain.A"] if relu else named["plain.H"], grad_a)
    dx_rows = tl.alloc("pbwd.dx_SD", S * D * dt)
    probe = tl.alloc("pbwd.wgrad_probe", D * G * dt)
    grads["w_up"] = tl.alloc("grad.w_up", E * D * G * dt)
    # the up-projection's node is the last to hold the offsets: released before its outputs
    # are handed on
    tl.free(probe, grad_h, named["plain.x_SD"], named["idx.expert_token_offsets"])
    wg.add(grads, "w_up")
    grads["x"] = tl.alloc("grad.x_chunk", C * D * dt)  # index_add_ into zeros, as dY
    tl.free(dx_rows, named["plain.eti64"])
    return grads


def chunk_tokens(num_tokens: int, num_chunks: int) -> list[int]:
    """Tokens per chunk as :func:`memfine.schedule.chunked.run_chunked` splits them."""
    if num_chunks == 1 or num_tokens == 0:
        return [num_tokens]
    base, extra = divmod(num_tokens, num_chunks)
    sizes = [base + 1 if i < extra else base for i in range(num_chunks)]
    return [c for c in sizes if c > 0]


@overload
def experts_forward(tl: Timeline, s: Shape, C: int, S: int, *, plain: bool, recompute: bool,
                    rerun: Literal[False] = False) -> tuple[list[str], str]: ...


@overload
def experts_forward(tl: Timeline, s: Shape, C: int, S: int, *, plain: bool, recompute: bool,
                    rerun: bool) -> tuple[list[str], str | None]: ...


def experts_forward(tl: Timeline, s: Shape, C: int, S: int, *, plain: bool, recompute: bool,
                    rerun: bool = False) -> tuple[list[str], str | None]:
    """One chunk: index build, expert path, drop the index object; returns (saved, out).

    ``recompute``: a checkpointed forward (nothing kept); ``rerun``: its recomputation in
    backward (stops early after the last saved tensor; the output is dropped).
    """
    arrays = index_forward(tl, s, C, S)
    if plain:
        saved, out = plain_forward(tl, s, C, S, early_stop=rerun)
        tl.free(arrays["eti"], arrays["tim"], arrays["esi"])
        saved.append(arrays["offs"])  # saved by both grouped matmuls
    else:
        lora_saved: list[str] = []
        hs, out = fused_forward(tl, s, C, S, lora_saved)
        saved = [*hs, arrays["eti"], arrays["offs"], arrays["tim"], arrays["esi"], *lora_saved]
    tl.free(arrays["tei"])
    if recompute:
        tl.free(*saved)
        saved = []
    if rerun and out is not None:
        tl.free(out)
        out = None
    return saved, out


def chunks_backward(tl: Timeline, s: Shape, sizes: list[int], chunk_saved: list[list[str]], *,
                    ckpt: bool, need_weights: bool = True,
                    after_first_chunk: Callable[[], None] | None = None
                    ) -> tuple[list[str], list[str]]:
    """Backward of every chunk, last chunk first (recomputed first under ``ckpt``).

    ``after_first_chunk`` runs once chunk 0's backward is done (the moment the routing weights
    saved by every chunk are released).

    Returns:
        The chunks' routing-weight gradients and their dx buffers, in backward order.
    """
    plain, K = s.moe.experts_impl == "plain", s.moe.top_k
    wg = WeightGrads(tl)
    # the fused chunks add into one buffer per weight (ops/weight_grads.py): no engine sum
    shared: dict[str, str] | None = {} if len(sizes) > 1 and not plain else None
    grads_w, grads_x = [], []
    for i in reversed(range(len(sizes))):
        C, saved = sizes[i], chunk_saved[i]
        if ckpt:
            saved, _ = experts_forward(tl, s, C, C * K, plain=plain, recompute=False,
                                       rerun=True)
        if plain:
            grads = plain_backward(tl, s, C, C * K, saved, wg)
        else:
            grads = fused_backward(tl, s, C, C * K, saved, shared, recomputed=ckpt,
                                   need_weights=need_weights)
        if i == 0 and after_first_chunk is not None:
            after_first_chunk()
        if "weights" in grads:
            grads_w.append(grads["weights"])
        wg.add(grads, *(n for n in grads if n.startswith("lora_")))  # the engine sums chunks
        grads_x.append(grads["x"])
    return grads_w, grads_x
