"""Analytic memory model of one MoE layer, itemised tensor by tensor (bytes; allocates nothing).

Saved-for-backward bytes are closed-form sums over the tensors memfine's code saves (router,
routing losses, and the expert path of each execution mode); they equal what saved-tensor hooks
measure (:class:`memfine.measure.saved.SavedTensorsTracker`) exactly. Peak bytes come from an
allocation timeline that replays the layer's forward and backward step by step
(:mod:`memfine.layer_timeline.layer`); they equal the allocations torch.profiler records
(:class:`memfine.measure.profiled.ProfiledPeakMemory`). The live-storage tracker
(:class:`memfine.measure.peak.PeakMemoryTracker`) sees the same except where its dispatch mode
makes autograd work out of place (the engine's sum of two gradients of one tensor, gather and
index_select backward): there it holds one buffer more than the program.

Execution modes (as :class:`memfine.nn.MoELayer` runs them):

- ``plain``: ``experts_impl="plain"`` — autograd over gathered/scattered copies.
- ``fused``: ``experts_impl="fused"`` — :class:`memfine.experts.FusedExpertsFunction` (x, H,
  weights, int32 indices).
- ``full``: recompute ``full`` or ``experts`` with c = 1 — only the layer input and the routing
  survive forward.
- ``chunked``: recompute ``experts`` with c > 1 — as ``full``, and backward recomputes one token
  chunk at a time (``recompute="none"`` with c > 1 chunks without recomputation).

The chunk policy (:mod:`memfine.schedule.policy`) asks :func:`layer_peak_bytes` (the timeline's
peak) once per (config, T, D_t, recompute, c) and picks the smallest bin that fits the budget;
:func:`expert_row_bytes` is the timeline's per-row slope (rows beyond T·k under expert
parallelism, and the row term of ``memfine plan``'s Eq. 8). :func:`ep_layer_peak_bytes` is the
peak of a layer whose routed experts run expert-parallel (:mod:`memfine.layer_timeline.ep`), from
each chunk's rows.

Legend: T tokens, S received rows (s′; S = T·k on one device), C tokens of one chunk,
E experts (on this rank), D = d, N = n, G = 2n (gated) or n, K = k, D_t activation bytes,
R = 4 router bytes (fp32; 8 for float64).
Reference: MemFine (arXiv 2511.21431) Table 2, Eq. 2, 8; MoEBlaze §4-§5;
docs/design.md §5; docs/style.md §7.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from memfine.config import MoEConfig, config_block_rows
from memfine.dispatch.index import sort_free_max_cells
from memfine.layer_timeline import layer as tlm
from memfine.layer_timeline.ep import simulate_ep_layer
from memfine.layer_timeline.shared import shared_saved_items
from memfine.memory.breakdown import ASSUMPTIONS, SAVED_FIELDS, MemoryBreakdown
from memfine.timeline.base import expert_saved

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
    T, D, K, dt = num_tokens, moe.hidden_size, moe.top_k, dtype_bytes
    fused, ckpt = moe.experts_impl == "fused", recompute != "none"
    items = dict.fromkeys(SAVED_FIELDS, 0)
    # The router node saves x (the experts' input too), its selection (and the masked index
    # with capacity) and small counts: no fp32 copy, no (T, E) tensor (docs/design.md §2).
    items["layer_input_bytes"] = T * D * dt
    items["top_k_index_bytes"] = T * K * 8 * (2 if moe.capacity_factor is not None else 1)
    items["top_k_weights_bytes"] = T * K * dt if (fused or ckpt) else 0
    chunks = tlm.chunk_tokens(T, num_chunks)
    if not ckpt:
        for C in chunks:
            for name, nbytes in expert_saved(moe, C, C * K, dt).items():
                items[name] += nbytes
    if moe.num_shared_experts:
        items.update(shared_saved_items(moe, chunks, dt, ckpt=ckpt,
                                        x_saved=items["layer_input_bytes"] > 0))
    return items


def moe_layer_timeline(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *,
                       num_chunks: int = 1, recompute: str = "none", device_type: str = "cpu",
                       block_rows: int | None = None) -> tlm.Timeline:
    """The allocation timeline of one MoELayer forward + backward (live set at the peak included).

    Args: as :func:`moe_layer_memory`.

    Returns:
        A :class:`memfine.layer_timeline.layer.Timeline`: ``peak``, ``peak_live`` (tensor name →
        bytes alive at the peak), ``marks`` and ``phase_peaks`` (``forward``, ``end``).

    Raises:
        ValueError: on out-of-range arguments.
    """
    _check(moe, num_tokens, dtype_bytes, num_chunks, recompute)
    return tlm.simulate_layer(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                              recompute=recompute, device_type=device_type,
                              block_rows=block_rows)


def moe_layer_memory(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *,
                     num_chunks: int = 1, recompute: str = "none",
                     optimizer_bytes_per_param: int = 0, device_type: str = "cpu",
                     block_rows: int | None = None) -> MemoryBreakdown:
    """Itemised bytes of one :class:`memfine.nn.MoELayer` forward + backward on one device.

    Args:
        moe: the layer config (``experts_impl`` ``fused`` or ``plain``).
        num_tokens: T, tokens entering the layer.
        dtype_bytes: D_t, bytes per element of x and the parameters (2, 4 or 8).
        num_chunks: c, token chunks of the expert part (:class:`memfine.config.ChunkConfig`).
        recompute: ``none``, ``experts`` or ``full``.
        optimizer_bytes_per_param: optimizer state per parameter, bytes (e.g. 8 for Adam's two
            fp32 moments); 0 when no optimizer is held.
        device_type: the activations' device: the choices the code makes by device (the
            ``auto`` index builder's size limit, :func:`memfine.dispatch.sort_free_max_cells`).
        block_rows: the fused path's rows per row block in the call (a chunk policy's
            ``ChunkDecision.block_rows``); None: the config's own on ``device_type``
            (:func:`memfine.config.config_block_rows`).

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
                            recompute=recompute, device_type=device_type,
                            block_rows=block_rows)
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
        **items,  # the saved int fields; assumptions named so that ** maps to ints only
        assumptions=ASSUMPTIONS,
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


def _chunk_trace(moe: MoEConfig, dtype_bytes: int, recompute: str, tokens: int,
                 device_type: str = "cpu") -> list[int]:
    """Live bytes after each event of one chunk's (re)computation and backward, from zero."""
    s = tlm.Shape(moe, tokens, dtype_bytes, device_type,
                  block_rows=config_block_rows(moe, dtype_bytes, device_type))
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


def expert_row_bytes(moe: MoEConfig, dtype_bytes: int, *, recompute: str = "experts",
                     device_type: str = "cpu") -> int:
    """Peak bytes that scale with the received rows of one chunk, per row.

    The largest per-row slope over one chunk's (re)computation and backward: its saved H and
    index arrays, gathered rows, dA, A, dH, dx rows and the (C, k, d) per-token gather, and the
    routing-index builder's dense map, whichever point of the chunk's life is largest per row.
    Per-token sizes count as 1/k per row (S_c = C·k: every token sends k rows).

    Args:
        moe: the layer config (E = experts on this rank).
        dtype_bytes: D_t.
        recompute: ``none``, ``experts`` or ``full`` (the slope is the same: a chunk's own
            tensors; under ``none`` the other chunks' saved H is part of the exact peak,
            :func:`layer_peak_bytes`).
        device_type: the activations' device (its default row blocks).

    Returns:
        Bytes per row (> 0), an int rounded up.

    Reference: MemFine Eq. 8 denominator (there: D_t·(2d + 2n) per row for Megatron's tensors);
    our timeline for memfine's own path.
    """
    _check(moe, 0, dtype_bytes, 1, recompute)
    best = 0
    for builder in ("sort_free", "argsort"):
        cfg = dataclasses.replace(moe, index_builder=builder)
        one, two = (_chunk_trace(cfg, dtype_bytes, recompute, n, device_type) for n in (1, 2))
        best = max(best, max(b - a for a, b in zip(one, two, strict=True)))
    return -(-best // moe.top_k)


def builder_switch_tokens(moe: MoEConfig, num_chunks: int, device_type: str = "cpu"
                          ) -> tuple[int, ...]:
    """The token counts T after which a chunk's ``auto`` index builder turns to argsort.

    The exact peak grows with T except where a chunk of T + 1 tokens leaves the sort-free
    builder for argsort (whose workspace is smaller): there it may fall. A search over T (MACT's
    :meth:`memfine.schedule.ChunkPolicy.token_limits`) checks these points too, so every T
    below its answer fits. Chunk i (largest first, as the chunk loop splits T) turns at
    T = c·⌊L/E⌋ + i, L = :func:`memfine.dispatch.sort_free_max_cells` of the device; the shared
    experts' index (E = their count) turns likewise.

    Args:
        moe: the layer config (``index_builder`` other than ``auto``: no switch).
        num_chunks: c.
        device_type: the activations' device.

    Returns:
        The switch points, ascending (empty for a fixed builder).
    """
    if moe.index_builder != "auto":
        return ()
    limit = sort_free_max_cells(device_type)
    experts = [moe.num_experts, *([moe.num_shared_experts] if moe.num_shared_experts else [])]
    return tuple(sorted({num_chunks * (limit // e) + i for e in experts
                         for i in range(num_chunks)}))


def layer_peak_bytes(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *,
                     num_chunks: int = 1, recompute: str = "none", device_type: str = "cpu",
                     block_rows: int | None = None) -> int:
    """The exact predicted peak of one MoELayer forward + backward, in bytes (MACT's model).

    The maximum of the allocation timeline (:func:`moe_layer_timeline`) replayed without
    recording the live set: the number the tests hold equal to ``torch.profiler``. The chunk
    policy (:class:`memfine.schedule.ChunkPolicy`) picks the smallest bin whose value fits the
    budget.

    Args: as :func:`moe_layer_memory` (without the optimizer state).

    Returns:
        Peak live bytes created inside forward + backward (the input x and parameters excluded).

    Raises:
        ValueError: on out-of-range arguments.

    Reference: MemFine Eq. 8-9 (the budget test) with our timeline for memfine's own path.
    """
    _check(moe, num_tokens, dtype_bytes, num_chunks, recompute)
    return tlm.simulate_layer(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                              recompute=recompute, record=False, device_type=device_type,
                              block_rows=block_rows).peak


def ep_layer_peak_bytes(moe: MoEConfig, num_tokens: int, dtype_bytes: int,
                        chunk_rows: Sequence[tuple[int, int]], *, local_experts: int,
                        recompute: str = "experts", device_type: str = "cpu",
                        block_rows: int | None = None, router: bool = True) -> int:
    """Predicted peak of one layer call whose routed experts run expert-parallel, in bytes.

    The maximum of :func:`memfine.layer_timeline.ep.simulate_ep_layer`: the router node, the
    dispatch plan of every chunk, and per chunk the all-to-alls' rows around the fused experts on
    the received rows. Without the router (``router=False``) it equals the live-storage
    tracker's peak of :meth:`memfine.parallel.ExpertParallelExperts.run` + backward under
    recompute ``experts``/``full`` (tests/parallel/test_ep_peak.py); under ``none`` it is a little
    above it (at most 24 bytes per routed row T·k there). An all-to-all buffer that gloo frees
    late is not in it (:meth:`memfine.schedule.ChunkPolicy.ep_peak` adds one).

    Args:
        moe: the layer config (E global; the fused path).
        num_tokens: T of this rank.
        dtype_bytes: D_t (2, 4 or 8).
        chunk_rows: per chunk in token order (M rows sent, S rows received), c = its length.
        local_experts: L = E / ep (≥ 1).
        recompute: ``none``, ``experts`` or ``full``.
        device_type: the activations' device.
        block_rows: rows per fused row block (None: the config's own).
        router: include the router node (a layer call); False: the experts' call alone.

    Returns:
        Peak live bytes created inside forward + backward (x, the routing without the router,
        and the parameters excluded).

    Raises:
        ValueError: on out-of-range arguments, an empty ``chunk_rows``, negative rows or
            ``local_experts`` < 1.
    """
    _check(moe, num_tokens, dtype_bytes, max(len(chunk_rows), 1), recompute)
    if not chunk_rows or any(m < 0 or s < 0 for m, s in chunk_rows):
        raise ValueError(f"chunk_rows must hold one (sent, received) pair of rows >= 0 per "
                         f"chunk, got {list(chunk_rows)}")
    if local_experts < 1:
        raise ValueError(f"local_experts must be >= 1, got {local_experts}")
    return simulate_ep_layer(moe, num_tokens, dtype_bytes, chunk_rows,
                             local_experts=local_experts, recompute=recompute,
                             device_type=device_type, block_rows=block_rows,
                             router=router).peak
