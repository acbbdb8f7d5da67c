"""Allocation timeline of memfine's fused experts Function, streamed over row blocks.

:func:`fused_forward` and :func:`fused_backward` mirror ``memfine.experts.function`` and
``memfine.experts.rows`` (the row plan, each block's transients, the weight-gradient buffers);
:func:`activation_forward` / :func:`activation_backward` the activation's own temporaries, which
the plain path (:mod:`memfine.timeline.experts`) shares.

Legend as in :mod:`memfine.timeline.experts`.
Reference: our derivation from the code (docs/design.md §5).
"""

from __future__ import annotations

from memfine.timeline import lora as adapters
from memfine.timeline.base import Shape, Timeline
from memfine.timeline.quant import dequantize


def activation_forward(tl: Timeline, s: Shape, S: int, prefix: str) -> str:
    """apply_activation on H (S, G) → A (S, n) without autograd (gated: act(gate) *= up)."""
    return tl.alloc(f"{prefix}.A", S * s.moe.intermediate_size * s.dt)


def _row_plan(tl: Timeline, s: Shape, S: int, rows: int, phase: str) -> list[str]:
    """ops.fused.rows.RowBlocks.plan, once per pass (forward and backward).

    w_S and, with several blocks, the (n_blocks, E + 1) int32 block offsets (the block starts
    are transient).
    """
    plan = [tl.alloc(f"{phase}.w_S", S * s.dt)]
    num_blocks = -(-S // rows)
    if num_blocks > 1:
        starts = tl.alloc(f"{phase}.block_starts", num_blocks * 4)
        plan.append(tl.alloc(f"{phase}.block_offsets", num_blocks * (s.moe.num_experts + 1) * 4))
        tl.free(starts)
    return plan


def _block_tokens(tl: Timeline, s: Shape, B: int, phase: str) -> list[str]:
    """experts.rows.block_tokens: the block's tokens as int64 on the CPU (B·8 bytes), else none."""
    return [tl.alloc(f"{phase}.token_B", B * 8)] if s.device_type == "cpu" else []


def fused_forward(tl: Timeline, s: Shape, C: int, S: int,
                  lora_saved: list[str] | None = None) -> tuple[list[str], str]:
    """FusedExpertsFunction.forward streamed over row blocks; returns (H per block, out).

    experts.rows.forward_rows. Per block of B rows: x rows, the block's H rows (kept: saved
    as they are), A, Y and w ⊙ Y (out of place), which is added into out in place
    (``index_add_``). The row plan (w_S, block offsets) lives for the forward. Split-LoRA
    adapters (a :class:`memfine.timeline.lora.LoRAShape`) add their terms per block; their
    saved U go to ``lora_saved``.
    """
    D, G, N = s.moe.hidden_size, s.moe.up_width, s.moe.intermediate_size
    kept = [] if lora_saved is None else lora_saved
    rows = s.block_rows
    plan = _row_plan(tl, s, S, rows, "fwd")
    out = tl.alloc("fwd.out", C * D * s.dt)
    hs = []
    for r0 in range(0, S, rows):
        B = min(S, r0 + rows) - r0
        tokens = _block_tokens(tl, s, B, "fwd")
        xg = tl.alloc("fwd.x_BD", B * D * s.dt)
        deq = dequantize(tl, s, "w_up", (r0, r0 + B, S))  # a 4-bit base's block experts
        hs.append(tl.alloc("fwd.H_block", B * G * s.dt))
        tl.free(*deq)
        kept += adapters.forward_term(tl, s, B, S, "up", first=r0 == 0)
        tl.free(xg)
        a = tl.alloc("fwd.A", B * N * s.dt)
        deq = dequantize(tl, s, "w_down", (r0, r0 + B, S))
        y = tl.alloc("fwd.Y", B * D * s.dt)
        tl.free(*deq)
        kept += adapters.forward_term(tl, s, B, S, "down", first=r0 == 0)
        tl.free(a)
        weighted = tl.alloc("fwd.wY", B * D * s.dt)  # w ⊙ Y, out of place
        tl.free(y, weighted, *tokens)
    if not hs:  # no rows
        hs.append(tl.alloc("fwd.H_block", 0))
    tl.free(*plan)
    return hs, out


def fused_backward(tl: Timeline, s: Shape, C: int, S: int, saved: list[str],
                   shared: dict[str, str] | None = None, *, recomputed: bool = False,
                   need_weights: bool = True) -> dict[str, str]:
    """FusedExpertsFunction.backward, streamed over row blocks; frees the chunk's saved tensors.

    ``shared``: the chunk loop's weight-gradient buffers (name → allocation), filled on first
    use and kept across chunks; ``None``: the Function's own buffers, returned in the result.
    ``recomputed``: the saved tensors come from a checkpoint's recomputation, which drops each
    one once unpacked, so token_index_map (unpacked, unused by backward) goes first.
    ``need_weights=False``: the routing weights need no gradient (shared experts without a
    gate): no row dots, no weight gradient (``grads["weights"]`` is absent).
    With one saved H per block (D_t ≠ 2: fp32/float64), each block's H is freed once its dH
    exists (the protocol's backward does not keep the graph); bf16 keeps H to the end.
    Returns the chunk's gradients (``weights``, ``x``, and ``w_up``/``w_down`` when owned).
    """
    moe, dt = s.moe, s.dt
    D, E, K = moe.hidden_size, moe.num_experts, moe.top_k
    buffers = {} if shared is None else shared
    grads = {"x": tl.alloc("grad.x_chunk", C * D * dt)}
    dots = [tl.alloc("bwd.row_dots_S", S * dt)] if need_weights else []
    if recomputed:
        tim = next(name for name in saved if name.startswith("idx.token_index_map"))
        saved = [name for name in saved if name != tim]
        tl.free(tim)
    rows = s.block_rows
    plan = _row_plan(tl, s, S, rows, "bwd")  # once per backward, as in forward
    grouped = grouped_weight_grads(s)
    lora_buffers: dict[str, str] = {}  # the adapters' own, per call (summed by the engine)
    starts = range(0, S, rows)
    hs = [name for name in saved if name.startswith("fwd.H_block")]
    if len(hs) != len(starts) or dt == 2:  # freed at the end, not per block (bf16: kept)
        hs = [""] * len(starts)
    saved = [name for name in saved if name not in hs]
    for r0, h in zip(starts, hs, strict=True):
        _fused_backward_block(tl, s, (r0, min(S, r0 + rows), S), buffers, grouped, lora_buffers,
                              need_weights, h)
    if need_weights:
        grads["weights"] = tl.alloc("grad.top_k_weights", C * K * dt)
        tl.free(tl.alloc("bwd.slot64", S * 8))
    adapters.hand_over(tl, s, lora_buffers)  # LoRABackward.take_grads, before the state goes
    tl.free(*plan)
    if shared is None and not adapters.base_frozen(s):  # a frozen base has no gradient
        for name, size in (("w_up", E * D * moe.up_width), ("w_down", E * moe.intermediate_size
                                                             * D)):
            grads[name] = buffers.get(name) or tl.alloc(f"grad.{name}", size * dt)
    grads.update(lora_buffers)
    tl.free(*dots, *saved)
    return grads


def grouped_weight_grads(s: Shape) -> dict[str, bool]:
    """Per weight, whether the fused backward's weight gradient is one grouped GEMM per block.

    :func:`memfine.ops.weight_grads.uses_grouped_weight_grads`: bf16 (D_t = 2 is read as
    bf16; fp16 is not modelled), not the ``loop`` backend, and the operands' rows multiples of
    16 bytes (w_up: x (d) and dH (G); w_down: A (n) and dO (d)); fewer than 1024 experts
    assumed (CUDA's limit). Otherwise the per-expert ``addmm_`` (no transient).
    """
    moe = s.moe
    if s.dt != 2 or moe.gemm_backend == "loop":
        return {"w_up": False, "w_down": False}

    def aligned(*widths: int) -> bool:
        return all(w * s.dt % 16 == 0 for w in widths)

    return {"w_up": aligned(moe.hidden_size, moe.up_width),
            "w_down": aligned(moe.intermediate_size, moe.hidden_size)}


def _weight_grad(tl: Timeline, s: Shape, buffers: dict[str, str], grouped: bool, name: str,
                 dims: tuple[int, int], block: tuple[int, int, int]) -> None:
    """One block's weight gradient into the buffer (``WeightGradBuffers.write_block_``).

    One block of all S rows (or fp32/float64 weights): the first grouped product is the
    buffer; a later chunk's products are per-expert ``addmm_`` in place (bf16 too: no
    buffer-sized transient). Several bf16/fp16 blocks: the buffer at the first block (its grouped
    product over all E experts when it holds at least half the rows), whole experts written in
    place per expert, and in every block the rows of an expert cut by a block edge cast to fp32
    (transient), whose fp32 (I, O) sum lives from the first block to the last. The cast rows
    follow the routing and are taken as one balanced expert's, min(B, ⌈S/E⌉); one fp32 sum per
    weight is open.
    """
    moe, dt = s.moe, s.dt
    E, (i_dim, o_dim) = moe.num_experts, dims
    r0, r1, S = block
    if dt != 2 or (r0 == 0 and r1 >= S):  # a later chunk's one bf16 block adds in place
        if name not in buffers:
            buffers[name] = tl.alloc(f"grad.{name}", E * i_dim * o_dim * dt)
        return
    B = r1 - r0
    if name not in buffers:  # a grouped first block of ≥ S/2 rows: its product is the buffer
        buffers[name] = tl.alloc(f"grad.{name}", E * i_dim * o_dim * dt)
    rows = min(B, -(-S // E))
    casts = [tl.alloc(f"bwd.{name}_rows_fp32", rows * i_dim * 4),
             tl.alloc(f"bwd.{name}_grad_rows_fp32", rows * o_dim * 4)]
    key = f"{name}.fp32_sum"
    if r0 == 0:
        buffers[key] = tl.alloc(f"bwd.{name}_fp32_sum", i_dim * o_dim * 4)
    tl.free(*casts)
    if r1 >= S:
        tl.free(buffers.pop(key))


def _fused_backward_block(tl: Timeline, s: Shape, block: tuple[int, int, int],
                          buffers: dict[str, str], grouped: dict[str, bool],
                          lora_buffers: dict[str, str], need_weights: bool = True,
                          h_block: str = "") -> None:
    """One row block [r0, r1) of S rows: dO rows, dA, A, dH, x rows, dx rows (in code order).

    ``h_block``: the block's saved H, freed once its dH exists ("": kept to the end).

    A (and a gated activation's f(gate), kept for dH) is recomputed only when something reads
    it: the routing-weight dots, W_down's gradient, or a down adapter's (as the code's
    ``need_a``); frozen experts whose routing weights need no gradient skip it.
    """
    moe, dt = s.moe, s.dt
    D, N, G = moe.hidden_size, moe.intermediate_size, moe.up_width
    B = block[1] - block[0]
    frozen = adapters.base_frozen(s)  # split LoRA or frozen shared experts: no base gradient
    lora = adapters.adapters_of(s)
    need_a = need_weights or not frozen or (lora is not None and "w_down" in lora.targets)
    tokens = _block_tokens(tl, s, B, "bwd")
    grad_out = tl.alloc("bwd.dO_BD", B * D * dt)
    deq = dequantize(tl, s, "w_down", block)  # a 4-bit base's block experts
    grad_a = tl.alloc("bwd.dA", B * N * dt)
    tl.free(*deq)
    gate = [tl.alloc("bwd.act_gate", B * N * dt)] if moe.gated and need_a else []  # for dH
    a = [activation_forward(tl, s, B, "bwd")] if need_a else []
    adapters.backward_down(tl, s, B, lora_buffers)
    if not frozen:
        _weight_grad(tl, s, buffers, grouped["w_down"], "w_down", (N, D), block)
    tl.free(*a, grad_out)
    grad_h = activation_backward(tl, s, B, gate_kept=bool(gate))
    tl.free(grad_a, *gate, *([h_block] if h_block else []))
    if not frozen:
        xg = tl.alloc("bwd.x_BD", B * D * dt)
        _weight_grad(tl, s, buffers, grouped["w_up"], "w_up", (D, G), block)
        tl.free(xg)
    lora_dx = adapters.backward_up(tl, s, B, lora_buffers, need_x=True)
    deq = dequantize(tl, s, "w_up", block)
    dx_rows = tl.alloc("bwd.dx_BD", B * D * dt)
    tl.free(*deq)
    tl.free(grad_h, dx_rows, *([lora_dx] if lora_dx else []), *tokens)


def activation_backward(tl: Timeline, s: Shape, S: int, *, gate_kept: bool = False) -> str:
    """activations.activation_backward: dH (S, G) from H and dA.

    Gated: f(gate) (unless ``gate_kept``) is a transient; both halves of dH, dA ⊙ up included,
    are written in place.
    """
    N, G = s.moe.intermediate_size, s.moe.up_width
    if not s.moe.gated:
        return tl.alloc("bwd.dH", S * N * s.dt)
    grad_h = tl.alloc("bwd.dH", S * G * s.dt)
    if not gate_kept:
        tl.free(tl.alloc("bwd.act_gate", S * N * s.dt))
    return grad_h
