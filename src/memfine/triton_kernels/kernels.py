"""Triton kernels of the fused expert path (imported on first launch, never at package import).

Legend: S routed rows, T tokens, K top-k slots, E experts, I input / O output features,
D = d, N = n. Tensors are addressed through explicit strides; all accumulation is fp32.
- ``_grouped_gemm_kernel``: out[r] = x[src(r)] · w[e(r)] (optionally × a per-row scale), where
  src(r) = expert_token_indices[r] when GATHER (gather fused into the load, no gathered copy)
  and r otherwise; programs walk a device-built tile schedule (one row tile never spans
  experts) over a fixed grid sized from shapes; the grid's spare tiles are empty and skip the
  K loop.
- ``_gather_up_kernel``: H = x[expert_token_indices] · w_up[e] with the activation in the
  epilogue: writes H (S, G) and A (S, n); gated activations keep two accumulators (gate, up).
- ``_combine_kernel``: out[t] = Σ_j rows[token_index_map[t, j]] over valid slots, in slot order
  (a per-token reduction: deterministic, no atomics; sentinel slots masked, never multiplied).
Addresses: every row, token and expert index is int64 before it meets a stride, so offsets
past 2³¹ elements (T·d ≥ 2³¹ in the combine, S·G in H) address correctly.
UPCAST converts tile operands to fp32 before ``tl.dot`` (the CPU interpreter computes bf16 dots
wrongly); IEEE asks for exact fp32 dots (no TF32) when the inputs are fp32. K_FIXED > 0 (the
interpreter) runs every tile's K loop to that constant (``in_features``) and lets the row mask
idle a spare tile; the combine's slot count K is a constant too: Triton 3.6's interpreter holds
every scalar argument and loaded scalar as a 1-element array, which numpy >= 2.4 refuses to turn
into a ``range`` bound.
Reference: MoEBlaze §4 (gather-fused GEMM, epilogue activation, per-token combine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfine._optional import require

if TYPE_CHECKING:  # the modules themselves, so that ``tl.constexpr`` names a type for mypy
    import triton
    import triton.language as tl
else:
    triton = require("triton")
    tl = require("triton.language")

ACT_SILU, ACT_GELU, ACT_RELU = 0, 1, 2


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _activate(v, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return v / (1.0 + tl.exp(-v))
    if ACT == 1:  # gelu, tanh approximation; tanh(u) = 2·sigmoid(2u) − 1
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        return v * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * u)))
    return tl.where(v > 0, v, 0.0)  # relu


@triton.jit
def _tile(tile_expert_ptr, tile_start_ptr, offsets_ptr, rows_ptr, in_features, out_features,
          BM: tl.constexpr, BN: tl.constexpr, GATHER: tl.constexpr):
    # This program's rows and output columns, and the K loop's bound: 0 for an idle tile
    # (start == end of its expert).
    pid_m = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    start = tl.load(tile_start_ptr + pid_m).to(tl.int64)
    end = tl.load(offsets_ptr + e + 1).to(tl.int64)
    offs_m = start + tl.arange(0, BM).to(tl.int64)
    mask_m = offs_m < end
    if GATHER:  # noqa: SIM108 (a constexpr branch: Triton compiles only the one taken)
        src = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        src = offs_m
    k_stop = in_features * (start < end).to(tl.int32)  # idle tiles of the fixed grid: no work
    offs_n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    return e, offs_m, mask_m, src, k_stop, offs_n, offs_n < out_features


@triton.jit
def _row_tile(x_ptr, src, mask_m, k0, in_features, stride_xs, stride_xi, BK: tl.constexpr):
    # The (BM, BK) tile of rows src, columns k0 .. k0 + BK of x, and its column offsets and mask.
    offs_k = k0 + tl.arange(0, BK)
    mask_k = offs_k < in_features
    a = tl.load(x_ptr + src[:, None] * stride_xs + offs_k[None, :] * stride_xi,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    return a, offs_k, mask_k


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, scale_ptr, tile_expert_ptr,
                         tile_start_ptr, offsets_ptr, in_features, out_features, stride_xs,
                         stride_xi, stride_we, stride_wi, stride_wo, stride_os, stride_oo,
                         GATHER: tl.constexpr, SCALE: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr, K_FIXED: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
    e, offs_m, mask_m, src, k_stop, offs_n, mask_n = _tile(
        tile_expert_ptr, tile_start_ptr, offsets_ptr, rows_ptr, in_features, out_features, BM,
        BN, GATHER)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # K_FIXED (the interpreter): a constant bound, used in place (a constant assigned to a name
    # becomes a 1-element array there), idle tiles masked row by row
    for k0 in range(0, K_FIXED if K_FIXED > 0 else k_stop, BK):
        a, offs_k, mask_k = _row_tile(x_ptr, src, mask_m, k0, in_features, stride_xs, stride_xi,
                                      BK)
        b = tl.load(w_ptr + e * stride_we + offs_k[:, None] * stride_wi
                    + offs_n[None, :] * stride_wo,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, UPCAST, IEEE)
    if SCALE:
        acc = acc * tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_os + offs_n[None, :] * stride_oo,
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gather_up_kernel(x_ptr, w_ptr, h_ptr, a_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr,
                      offsets_ptr, in_features, N, stride_xs, stride_xi, stride_we, stride_wi,
                      stride_wo, stride_hs, stride_hg, stride_as, stride_an, GATED: tl.constexpr,
                      ACT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                      K_FIXED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
    e, offs_m, mask_m, src, k_stop, offs_n, mask_n = _tile(
        tile_expert_ptr, tile_start_ptr, offsets_ptr, rows_ptr, in_features, N, BM, BN, True)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    # K_FIXED (the interpreter): a constant bound, used in place (a constant assigned to a name
    # becomes a 1-element array there), idle tiles masked row by row
    for k0 in range(0, K_FIXED if K_FIXED > 0 else k_stop, BK):
        a, offs_k, mask_k = _row_tile(x_ptr, src, mask_m, k0, in_features, stride_xs, stride_xi,
                                      BK)
        w_tile = w_ptr + e * stride_we + offs_k[:, None] * stride_wi + offs_n[None, :] * stride_wo
        mask_w = mask_k[:, None] & mask_n[None, :]
        acc = _dot(a, tl.load(w_tile, mask=mask_w, other=0.0), acc, UPCAST, IEEE)
        if GATED:  # the up half sits n columns to the right of the gate half
            up = tl.load(w_tile + N * stride_wo, mask=mask_w, other=0.0)
            acc_up = _dot(a, up, acc_up, UPCAST, IEEE)
    mask = mask_m[:, None] & mask_n[None, :]
    h_tile = h_ptr + offs_m[:, None] * stride_hs + offs_n[None, :] * stride_hg
    h = acc.to(h_ptr.dtype.element_ty)
    tl.store(h_tile, h, mask=mask)
    act = _activate(h.to(tl.float32), ACT)  # from the rounded H, as the backward recomputes it
    if GATED:
        h_up = acc_up.to(h_ptr.dtype.element_ty)
        tl.store(h_tile + N * stride_hg, h_up, mask=mask)
        act = act.to(h_ptr.dtype.element_ty).to(tl.float32) * h_up.to(tl.float32)
    tl.store(a_ptr + offs_m[:, None] * stride_as + offs_n[None, :] * stride_an,
             act.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(rows_ptr, map_ptr, out_ptr, T, D, K: tl.constexpr, stride_rs, stride_rd,
                    stride_mt, stride_mk, stride_ot, stride_od, BT: tl.constexpr,
                    BD: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    offs_d = tl.program_id(1).to(tl.int64) * BD + tl.arange(0, BD)
    mask_t = offs_t < T
    mask_d = offs_d < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in range(0, K):
        r = tl.load(map_ptr + offs_t * stride_mt + j * stride_mk, mask=mask_t, other=-1)
        valid = r >= 0
        rows = tl.load(rows_ptr + r.to(tl.int64)[:, None] * stride_rs + offs_d[None, :] * stride_rd,
                       mask=valid[:, None] & mask_d[None, :], other=0.0)
        acc += rows.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])
