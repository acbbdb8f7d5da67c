"""The chunk policy of a layer with split-LoRA experts: MACT on the LoRA layer's peak.

Reference: MemFine §4 (MACT); docs/lora.md.
"""

from __future__ import annotations

from memfine.config import ChunkConfig, MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.memory.lora import lora_layer_memory
from memfine.schedule.policy import ChunkPolicy


class LoRAChunkPolicy(ChunkPolicy):
    """:class:`ChunkPolicy` of a layer with split-LoRA experts: MACT on the LoRA layer's peak.

    The layer peak of each c is the LoRA timeline's (:func:`memfine.memory.lora.
    lora_layer_memory`: adapters' U, products and gradient buffers, no base weight gradient),
    which the tests hold equal to the measured peak.
    """

    def __init__(self, chunk: ChunkConfig, moe: MoEConfig, lora: LoRAConfig) -> None:
        """As :class:`ChunkPolicy`, for experts with the adapters of ``lora``."""
        super().__init__(chunk, moe)
        self.lora = lora

    def model_peak(self, num_tokens: int, dtype_bytes: int, num_chunks: int, recompute: str,
                   device_type: str, block_rows: int) -> int:
        """The LoRA layer's exact timeline peak at c chunks (uncached), bytes."""
        return lora_layer_memory(self.moe, self.lora, num_tokens, dtype_bytes,
                                 num_chunks=num_chunks, recompute=recompute,
                                 device_type=device_type, block_rows=block_rows).peak_bytes
