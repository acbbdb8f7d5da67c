"""Allocation timeline of a 4-bit (NF4) frozen base: the per-block dequantised experts.

Mirrors :class:`memfine.lora.quant.NF4Experts` as read by the fused path: where a row block
reads ``w[held]`` its product dequantises the experts it holds, at most m at once
(:func:`memfine.config.lora.dequant_window`, from the row block's rows), so the transient is
min(E, m)·I·O·D_t bytes, live with the product (forward: H's product for w_up, Y for w_down;
backward: dA for w_down, the dx rows for w_up). A block holding more than m experts writes
each window's rows into its (B, O) product, the same bytes. Exact whenever the block at the
peak holds at least m experts (a full window); a block holding fewer dequantises fewer, so
the model bounds the measurement whatever the routing. The resident codes and absmax are
buffers, not activations (:func:`resident_bytes`).

Legend as :mod:`memfine.timeline.experts`.
Reference: our derivation from the code (docs/lora.md "QLoRA").
"""

from __future__ import annotations

from memfine.config.lora import dequant_window
from memfine.timeline.base import Shape, Timeline
from memfine.timeline.lora import adapters_of


def quantized(s: Shape) -> bool:
    """True when the experts' frozen base is held 4-bit (``LoRAConfig.base_quant``)."""
    lora = adapters_of(s)
    return lora is not None and lora.base_quant is not None


def dequantize(tl: Timeline, s: Shape, which: str, block: tuple[int, int, int]) -> list[str]:
    """``w[held]`` of a row block (r0, r1, S): its window of ``which`` (w_up / w_down).

    Returns:
        The transient's name in a list (free it after the block's product), or an empty list
        when the base is not 4-bit.
    """
    if not quantized(s):
        return []
    moe = s.moe
    D, N, G = moe.hidden_size, moe.intermediate_size, moe.up_width
    held = dequant_window(s.block_rows, moe.num_experts, D, N, G)  # min(E, m), whatever the block
    per = (moe.hidden_size * moe.up_width if which == "w_up"
           else moe.intermediate_size * moe.hidden_size)
    return [tl.alloc(f"{which}_dequantized", held * per * s.dt)]


def resident_bytes(num_experts: int, hidden_size: int, intermediate_size: int, up_width: int,
                   block_size: int = 64) -> int:
    """Bytes of one layer's 4-bit w_up + w_down, as ``LoRAGroupedExperts.quantize_base_`` holds.

    Codes (½ byte per value), one fp32 absmax per block of ``block_size`` values and the 16
    fp32 NF4 levels (64 bytes).
    """
    numel = num_experts * hidden_size * (up_width + intermediate_size)
    return numel // 2 + 4 * (numel // block_size) + 64
