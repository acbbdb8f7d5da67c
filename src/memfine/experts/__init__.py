"""The routed experts' computation: plain or fused, with split LoRA.

- :mod:`memfine.experts.run`: :func:`run_experts` (the one entry point: ``plain`` or ``fused``),
  the plain path and autocast of the operands.
- :mod:`memfine.experts.function`: the fused experts Function (MoEBlaze §4): gather +
  up-projection + activation, then down-projection + weighted combine, saving only x and H; its
  streamed backward.
- :mod:`memfine.ops.up_projection`: the up-projection layouts.
- :mod:`memfine.experts.lora_experts`: split LoRA on the experts (its adapter math and 4-bit base:
  :mod:`memfine.lora`).
- :mod:`memfine.experts.device_path`: the fused path another device takes, run on the CPU (for
  counting that device's ops).
"""

from memfine.experts.function import FusedExpertsFunction, FusedOptions
from memfine.experts.run import (
    autocast_operands,
    compute_element_size,
    experts_plain,
    run_experts,
)

__all__ = ["FusedExpertsFunction", "FusedOptions", "autocast_operands", "compute_element_size",
           "experts_plain", "run_experts"]
