"""Analytic memory model of one MoE layer, itemised tensor by tensor (bytes; allocates nothing).

Saved-for-backward bytes are closed-form sums over the tensors memfine's code saves (router,
routing losses, and the expert path of each execution mode); they equal what saved-tensor hooks
measure (:class:`memfine.measure.saved.SavedTensorsTracker`) exactly. Peak bytes come from an
allocation timeline that replays the layer's forward and backward step by step
(:mod:`memfine.memory.timeline.layer`); they equal what the live-storage tracker
(:class:`memfine.measure.peak.PeakMemoryTracker`) measures.

Execution modes (as :class:`memfine.nn.MoELayer` runs them):

- ``plain``: ``experts_impl="plain"`` — autograd over gathered/scattered copies.
- ``fused``: ``experts_impl="fused"`` — :class:`memfine.ops.FusedExpertsFunction` (x, H, weights,
  int32 indices).
- ``full``: recompute ``full`` or ``experts`` with c = 1 — only the layer input and the routing
  survive forward.
- ``chunked``: recompute ``experts`` with c > 1 — as ``full``, and backward recomputes one token
  chunk at a time (``recompute="none"`` with c > 1 chunks without recomputation).

The chunk policy (:mod:`memfine.schedule.policy`) calls :func:`chunk_bytes` once per (config, T,
D_t) to turn a byte budget into s′_max rows (MemFine Eq. 8): ``fixed + row · rows_per_chunk``
bounds the layer's peak from above for every chunk count up to ``MAX_BOUNDED_CHUNKS``.

Legend: T tokens, S received rows (s′; S = T·k on one device), C tokens of one chunk,
E experts (on this rank), D = d, N = n, G = 2n (gated) or n, K = k, D_t activation bytes,
R = 4 router bytes (fp32; 8 for float64).
Reference: MemFine (arXiv 2511.21431) Table 2, Eq. 2, 8; MoEBlaze §4-§5;
docs/design.md §5; docs/style.md §7.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfine.config import MAX_BIN, MoEConfig
from memfine.memory.breakdown import SAVED_FIELDS, MemoryBreakdown
from memfine.memory.timeline import layer as tlm
from memfine.memory.timeline.shared import shared_saved_items

MODES = ("plain", "fused", "full", "chunked")


def mode_settings(mode: str, num_chunks: int = 1) -> tuple[str, int, str]:
    """``(experts_impl, num_chunks, recompute)`` of an execution mode name.

    Raises:
        ValueError: on an unknown mode, or ``chunked`` with fewer than 2 chunks.
    """
    if mode == "plain":
        return "plain", 1, "none"
    if mode == "fused":
        return "fused", 1, "none"
    if mode == "full":
        return "fused", 1, "full"
    if mode == "chunked":
        if num_chunks < 2:
            raise ValueError(f"mode 'chunked' needs num_chunks >= 2, got {num_chunks}")
        return "fused", num_chunks, "experts"
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _check(moe: MoEConfig, num_tokens: int, dtype_bytes: int, num_chunks: int,
           recompute: str) -> None:
    if not isinstance(moe, MoEConfig):
        raise ValueError(f"moe must be a MoEConfig, got {type(moe).__name__}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if dtype_bytes not in (2, 4, 8):
        raise ValueError(f"dtype_bytes must be 2, 4 or 8, got {dtype_bytes}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if recompute not in ("none", "experts", "full"):
        raise ValueError(f"recompute must be 'none', 'experts' or 'full', got {recompute!r}")


def _expert_saved(moe: MoEConfig, C: int, S: int, dt: int) -> dict[str, int]:
    """Saved bytes of one chunk's expert path (no recompute), by field."""
    D, N, G, E, K = (moe.hidden_size, moe.intermediate_size, moe.up_width, moe.num_experts,
                     moe.top_k)
    if moe.experts_impl == "fused":
        return {"pre_activation_bytes": S * G * dt,
                "routing_index_bytes": 4 * (2 * S + C * K + E + 1)}
    keeps_h = moe.activation != "relu"  # relu saves its output A, not H
    return {
        "pre_activation_bytes": S * G * dt if keeps_h else 0,
        "routing_index_bytes": 4 * (E + 1),  # offsets, saved by both grouped matmuls
        "gathered_input_bytes": S * D * dt + S * 8,
        "activation_output_bytes": S * N * dt * (2 if moe.gated else 1),
        "combine_copy_bytes": C * K * (D * dt + dt + 8 + 2),
    }


def saved_items(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *, num_chunks: int = 1,
                recompute: str = "none") -> dict[str, int]:
    """Saved-for-backward bytes of one MoELayer forward, by :class:`MemoryBreakdown` field.

    Counts each storage once and leaves out parameters, as the saved-tensor hooks do.

    Args:
        moe: the layer's config (its ``experts_impl`` selects the fused or plain path).
        num_tokens: T.
        dtype_bytes: D_t of x and the expert weights (2 bf16, 4 fp32, 8 float64).
        num_chunks: c.
        recompute: ``none``, ``experts`` or ``full`` (as :class:`memfine.config.ChunkConfig`).

    Returns:
        Field name → bytes (fields that are zero are included).

    Raises:
        ValueError: on out-of-range arguments.
    """
    _check(moe, num_tokens, dtype_bytes, num_chunks, recompute)
    T, D, E, K, dt = num_tokens, moe.hidden_size, moe.num_experts, moe.top_k, dtype_bytes
    r = 8 if dt == 8 else 4
    fused, ckpt = moe.experts_impl == "fused", recompute != "none"
    items = dict.fromkeys(SAVED_FIELDS, 0)
    # x is saved by the fp32 router matmul, else by the fused Function or the checkpoint.
    items["layer_input_bytes"] = T * D * dt if (dt == r or fused or ckpt) else 0
    if dt != r:
        items["router_input_copy_bytes"] = T * D * r
        items["router_weight_copy_bytes"] = E * D * r
    items["router_scores_bytes"] = T * E * r
    items["top_k_index_bytes"] = T * K * 8
    if moe.renormalize:
        items["top_k_scores_bytes"] = T * K * r
        items["renorm_sum_bytes"] = T * r
    items["top_k_weights_bytes"] = T * K * dt if (fused or ckpt) else 0
    items["aux_loss_bytes"] = T * E * r + E * r
    items["z_loss_bytes"] = T * E * r + T * r
    chunks = tlm.chunk_tokens(T, num_chunks)
    if not ckpt:
        for C in chunks:
            for name, nbytes in _expert_saved(moe, C, C * K, dt).items():
                items[name] += nbytes
    if moe.num_shared_experts:
        items.update(shared_saved_items(moe, chunks, dt, ckpt=ckpt,
                                        x_saved=items["layer_input_bytes"] > 0))
    return items


def moe_layer_timeline(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *,
                       num_chunks: int = 1, recompute: str = "none") -> tlm.Timeline:
    """The allocation timeline of one MoELayer forward + backward (live set at the peak included).

    Args: as :func:`moe_layer_memory`.

    Returns:
        A :class:`memfine.memory.timeline.layer.Timeline`: ``peak``, ``peak_live`` (tensor name →
        bytes alive at the peak), ``marks`` and ``phase_peaks`` (``forward``, ``end``).

    Raises:
        ValueError: on out-of-range arguments.
    """
    _check(moe, num_tokens, dtype_bytes, num_chunks, recompute)
    return tlm.simulate_layer(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                              recompute=recompute)


def moe_layer_memory(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *,
                     num_chunks: int = 1, recompute: str = "none",
                     optimizer_bytes_per_param: int = 0) -> MemoryBreakdown:
    """Itemised bytes of one :class:`memfine.nn.MoELayer` forward + backward on one device.

    Args:
        moe: the layer config (``experts_impl`` ``fused`` or ``plain``).
        num_tokens: T, tokens entering the layer.
        dtype_bytes: D_t, bytes per element of x and the parameters (2, 4 or 8).
        num_chunks: c, token chunks of the expert part (:class:`memfine.config.ChunkConfig`).
        recompute: ``none``, ``experts`` or ``full``.
        optimizer_bytes_per_param: optimizer state per parameter, bytes (e.g. 8 for Adam's two
            fp32 moments); 0 when no optimizer is held.

    Returns:
        The :class:`MemoryBreakdown`.

    Raises:
        ValueError: on out-of-range arguments.

    Reference: MemFine Eq. 1-3 and Table 2 (items), docs/design.md §5; the peak is our timeline.
    """
    if optimizer_bytes_per_param < 0:
        raise ValueError(f"optimizer_bytes_per_param must be >= 0, got "
                         f"{optimizer_bytes_per_param}")
    items = saved_items(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                        recompute=recompute)
    tl = moe_layer_timeline(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                            recompute=recompute)
    D, N, G, E, K = (moe.hidden_size, moe.intermediate_size, moe.up_width, moe.num_experts,
                     moe.top_k)
    dt = dtype_bytes
    C = tlm.chunk_tokens(num_tokens, num_chunks)[0]
    S_c = C * K
    num_params = E * D * G + E * N * D + E * D
    if moe.num_shared_experts:
        sh = moe.shared_experts_config()
        num_params += sh.num_experts * D * (sh.up_width + sh.intermediate_size)
        num_params += D if moe.shared_expert_gate else 0
    return MemoryBreakdown(
        parameter_bytes=num_params * dt,
        gradient_bytes=num_params * dt,
        optimizer_state_bytes=num_params * optimizer_bytes_per_param,
        **items,
        saved_bytes=sum(items.values()),
        transient_gathered_rows_bytes=S_c * D * dt,
        transient_pre_activation_grad_bytes=S_c * G * dt,
        transient_expanded_dx_bytes=C * K * D * dt,
        transient_index_build_bytes=C * (E + 1) * 8 + 2 * C * E * 8,
        all_to_all_bytes=0,
        forward_peak_bytes=tl.phase_peaks["forward"],
        backward_peak_bytes=tl.phase_peaks["end"],
        peak_bytes=tl.peak,
        total_bytes=num_params * (dt + optimizer_bytes_per_param) + tl.peak,
    )


def _chunk_trace(moe: MoEConfig, dtype_bytes: int, recompute: str, tokens: int) -> list[int]:
    """Live bytes after each event of one chunk's (re)computation and backward, from zero."""
    s = tlm.Shape(moe, tokens, dtype_bytes)
    tl = tlm.Timeline()
    saved, _ = tlm.experts_forward(tl, s, tokens, tokens * moe.top_k,
                                   plain=moe.experts_impl == "plain", recompute=False,
                                   rerun=recompute != "none")
    if moe.experts_impl == "plain":
        tlm.plain_backward(tl, s, tokens, tokens * moe.top_k, saved, tlm.WeightGrads(tl))
    else:
        tlm.fused_backward(tl, s, tokens, tokens * moe.top_k, saved,
                           recomputed=recompute != "none")
    return tl.trace


def expert_row_bytes(moe: MoEConfig, dtype_bytes: int, *, recompute: str = "experts") -> int:
    """Peak bytes that scale with the received rows of one chunk, per row.

    The largest per-row slope over one chunk's (re)computation and backward: its saved H and
    index arrays, gathered rows, dA, A, dH, dx rows and the (C, k, d) per-token gather, and the
    routing-index builder's dense map, whichever point of the chunk's life is largest per row.
    Per-token sizes count as 1/k per row (S_c = C·k: every token sends k rows).

    Args:
        moe: the layer config (E = experts on this rank).
        dtype_bytes: D_t.
        recompute: ``none``, ``experts`` or ``full`` (the slope is the same: a chunk's own
            tensors; under ``none`` the other chunks' saved H is in :func:`expert_fixed_bytes`).

    Returns:
        Bytes per row (> 0), an int rounded up.

    Reference: MemFine Eq. 8 denominator (there: D_t·(2d + 2n) per row for Megatron's tensors);
    our timeline for memfine's own path.
    """
    _check(moe, 0, dtype_bytes, 1, recompute)
    best = 0
    for builder in ("sort_free", "argsort"):
        cfg = dataclasses.replace(moe, index_builder=builder)
        one, two = (_chunk_trace(cfg, dtype_bytes, recompute, n) for n in (1, 2))
        best = max(best, max(b - a for a, b in zip(one, two, strict=True)))
    return -(-best // moe.top_k)


MAX_BOUNDED_CHUNKS = MAX_BIN
"""The bound of :func:`expert_fixed_bytes` holds for every c in 1..MAX_BOUNDED_CHUNKS."""


def _fixed_bytes(num_tokens: int, moe: MoEConfig, dtype_bytes: int, recompute: str,
                 row_bytes: int) -> int:
    fixed = 0
    for c in range(1, MAX_BOUNDED_CHUNKS + 1):
        peak = tlm.simulate_layer(moe, num_tokens, dtype_bytes, num_chunks=c,
                                  recompute=recompute, record=False).peak
        rows = tlm.chunk_tokens(num_tokens, c)[0] * moe.top_k
        fixed = max(fixed, peak - row_bytes * rows)
    return fixed


def expert_fixed_bytes(num_tokens: int, moe: MoEConfig, dtype_bytes: int, *,
                       recompute: str = "experts") -> int:
    """Bytes of the layer's peak that do not scale with the rows of one chunk.

    Defined so that ``expert_fixed_bytes(T) + expert_row_bytes() · ⌈T/c⌉·k`` is at least the
    timeline peak of the whole MoELayer forward + backward for every c in 1..16
    (:data:`MAX_BOUNDED_CHUNKS`; the caller may keep MoEAux): router and loss tensors, the
    output, weight gradients (twice while the chunks' gradients are summed), the other chunks'
    input gradients and, under ``none``, the other chunks' saved H. Replays the allocation
    timeline 16 times: callers that ask repeatedly keep a :class:`ChunkBytes`
    (:func:`chunk_bytes`).

    Args:
        num_tokens: T, tokens entering the layer on this rank.
        moe: the layer config (E = experts on this rank).
        dtype_bytes: D_t.
        recompute: ``none``, ``experts`` or ``full``.

    Returns:
        Bytes (≥ 0).

    Reference: MemFine Eq. 8 numerator (the memory that does not scale with s′); our timeline.
    """
    return chunk_bytes(num_tokens, moe, dtype_bytes, recompute=recompute).fixed_bytes


@dataclass(frozen=True, slots=True)
class ChunkBytes:
    """The layer's peak as a line in the rows of one chunk: ``fixed_bytes + row_bytes · rows``.

    An upper bound on the timeline peak for every chunk count c in 1..MAX_BOUNDED_CHUNKS (exact
    for one of them), so MemFine Eq. 8-9 become integer arithmetic on these two numbers.

    Attributes:
        fixed_bytes: bytes that do not scale with the rows of one chunk (Eq. 8 numerator part).
        row_bytes: bytes per received row of one chunk (Eq. 8 denominator), > 0.
    """

    fixed_bytes: int
    row_bytes: int


def chunk_bytes(num_tokens: int, moe: MoEConfig, dtype_bytes: int, *,
                recompute: str = "experts") -> ChunkBytes:
    """:func:`expert_fixed_bytes` and :func:`expert_row_bytes` of one (config, T, D_t), together.

    Args: as :func:`expert_fixed_bytes`.

    Returns:
        The :class:`ChunkBytes` (16 layer timeline replays, one per c, plus four one-chunk traces
        for the row slope).

    Raises:
        ValueError: on out-of-range arguments.
    """
    _check(moe, num_tokens, dtype_bytes, 1, recompute)
    row = expert_row_bytes(moe, dtype_bytes, recompute=recompute)
    return ChunkBytes(fixed_bytes=_fixed_bytes(num_tokens, moe, dtype_bytes, recompute, row),
                      row_bytes=row)
