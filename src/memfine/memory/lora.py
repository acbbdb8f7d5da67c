"""Memory of one MoE layer whose routed experts carry split-LoRA adapters on a frozen base.

:func:`memfine.memory.layer.moe_layer_memory` with the adapters counted: each chunk's fused call
saves U (S_c·r) per adapter beside x and H; forward adds the adapters' products (transients of
H's and Y's size); backward allocates no gradient for the frozen base weights (nor for a
frozen router) but the adapters' gradient buffers and their per-block rank-r transients
(:mod:`memfine.timeline.lora`). A frozen router's fp32 matmul (bf16 runs) keeps no copy
of x. The peak is the allocation timeline's, as for a layer without adapters.

Legend: T tokens, K = k, S_c = C·k rows of a chunk, r the adapters' rank, D_t bytes per element.
Reference: our derivation from the code (docs/lora.md "Memory"); MemFine Eq. 2 (saved terms).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfine.config import MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.layer_timeline.layer import simulate_layer
from memfine.memory.layer import saved_items
from memfine.timeline.experts import chunk_tokens
from memfine.timeline.lora import adapter_saved_bytes
from memfine.timeline.quant import resident_bytes


@dataclass(frozen=True, slots=True)
class LoRALayerMemory:
    """Bytes of one LoRA MoE layer's forward + backward (the measurement's protocol).

    Attributes:
        saved_bytes: saved for backward at the end of forward (parameters left out).
        adapter_saved_bytes: the part of ``saved_bytes`` that the adapters add (U per adapter
            and chunk; 0 under recompute).
        forward_peak_bytes: peak live bytes during forward.
        peak_bytes: peak live bytes over forward + backward.
    """

    saved_bytes: int
    adapter_saved_bytes: int
    forward_peak_bytes: int
    peak_bytes: int


def lora_layer_memory(moe: MoEConfig, lora: LoRAConfig, num_tokens: int, dtype_bytes: int, *,
                      num_chunks: int = 1, recompute: str = "none", device_type: str = "cpu",
                      block_rows: int | None = None) -> LoRALayerMemory:
    """Saved and peak bytes of a :class:`memfine.nn.MoELayer` built with ``lora=``.

    Args:
        moe: the layer config (the fused experts path; LoRA needs it).
        lora: the adapters (rank, targets, ``train_router``).
        num_tokens: T.
        dtype_bytes: D_t of x, weights and adapters (2 or 4; 8 for float64).
        num_chunks: c.
        recompute: ``none``, ``experts`` or ``full``.
        device_type: the activations' device (the ``auto`` index builder's rule).
        block_rows: rows per fused row block (None: the config's own on ``device_type``).

    Returns:
        :class:`LoRALayerMemory`.

    Raises:
        ValueError: on out-of-range arguments (as :func:`memfine.memory.layer.saved_items`), or
            a config whose experts are not fused.
    """
    if moe.experts_impl != "fused":
        raise ValueError(f"LoRA on the experts needs MoEConfig.experts_impl='fused', got "
                         f"{moe.experts_impl!r}")
    items = saved_items(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                        recompute=recompute)
    extra = 0
    if recompute == "none":
        extra = sum(adapter_saved_bytes(lora, C * moe.top_k, dtype_bytes)
                    for C in chunk_tokens(num_tokens, num_chunks))
    tl = simulate_layer(moe, num_tokens, dtype_bytes, num_chunks=num_chunks,
                        recompute=recompute, lora=lora, device_type=device_type,
                        block_rows=block_rows)
    return LoRALayerMemory(saved_bytes=sum(items.values()) + extra, adapter_saved_bytes=extra,
                           forward_peak_bytes=tl.phase_peaks["forward"], peak_bytes=tl.peak)


def quantized_base_bytes(moe: MoEConfig, lora: LoRAConfig | None) -> int:
    """Resident bytes of one layer's 4-bit routed-expert base (0 without ``base_quant``).

    NF4 codes (½ byte per value), fp32 absmax per ``base_quant_block_size`` values and the 16
    NF4 levels (:meth:`memfine.nn.lora.LoRAGroupedExperts.quantize_base_`); these buffers are
    not parameters, so a parameter count leaves them out.
    """
    if lora is None or lora.base_quant is None:
        return 0
    return resident_bytes(moe.num_experts, moe.hidden_size, moe.intermediate_size,
                          moe.up_width, lora.base_quant_block_size)
