"""The fused experts Function (MoEBlaze §4), its streamed backward and weight-gradient buffers.

Gather + up-projection + activation, then down-projection + weighted combine, saving only x and H.
"""

from memfine.ops.fused.function import FusedExpertsFunction, FusedOptions

__all__ = ["FusedExpertsFunction", "FusedOptions"]
