"""Expert math's building blocks: grouped GEMMs, weight gradients, gather/combine.

The activations (:mod:`memfine.activations`) are re-exported here.

The expert computation built on them (``run_experts``, the fused Function, split LoRA) is
:mod:`memfine.experts`; the optional Triton kernels are :mod:`memfine.triton_kernels`.
"""

from memfine.activations import activation_backward, apply_activation
from memfine.ops.combine import combine_rows, gather_rows, reduce_rows
from memfine.ops.grouped import grouped_mm, grouped_mm_supported, grouped_weight_grad
from memfine.ops.grouped_function import GroupedMatmulFunction

__all__ = [
    "GroupedMatmulFunction",
    "activation_backward",
    "apply_activation",
    "combine_rows",
    "gather_rows",
    "grouped_mm",
    "grouped_mm_supported",
    "grouped_weight_grad",
    "reduce_rows",
]
