"""The split LoRA's adapter math and the 4-bit (NF4) base, below the experts path.

- :mod:`memfine.lora.adapters`: the adapters of one fused experts call (:class:`ExpertLoRA`,
  :class:`LoRASpec`) and their forward and streamed backward terms per row block
  (:class:`LoRAForward`, :class:`LoRABackward`); x·W + s·(x·Aᵀ)·Bᵀ, never W + B·A.
- :mod:`memfine.lora.quant`: frozen expert weights held 4-bit NF4 (QLoRA), dequantised per row
  block (:class:`NF4Experts`, :class:`QuantizedBase`).

:mod:`memfine.experts.function` runs them; docs/lora.md.
"""

from memfine.lora.adapters import ExpertLoRA, LoRABackward, LoRAForward, LoRASpec, dropout_mask
from memfine.lora.quant import NF4Experts, QuantizedBase, check_quantisable

__all__ = ["ExpertLoRA", "LoRABackward", "LoRAForward", "LoRASpec", "NF4Experts", "QuantizedBase",
           "check_quantisable", "dropout_mask"]
