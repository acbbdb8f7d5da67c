"""Expert math: grouped GEMM backends, activations, combine, the fused expert Function."""

from memfine.ops.activations import activation_backward, apply_activation
from memfine.ops.combine import combine_rows, gather_rows, reduce_rows
from memfine.ops.experts import autocast_operands, experts_plain, run_experts
from memfine.ops.fused.function import FusedExpertsFunction
from memfine.ops.grouped import grouped_mm, grouped_mm_supported, grouped_weight_grad
from memfine.ops.grouped_function import GroupedMatmulFunction

__all__ = [
    "FusedExpertsFunction",
    "GroupedMatmulFunction",
    "activation_backward",
    "apply_activation",
    "autocast_operands",
    "combine_rows",
    "experts_plain",
    "gather_rows",
    "grouped_mm",
    "grouped_mm_supported",
    "grouped_weight_grad",
    "reduce_rows",
    "run_experts",
]
