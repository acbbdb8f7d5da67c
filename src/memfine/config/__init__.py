"""Frozen, keyword-only configuration dataclasses, validated on construction.

- :mod:`memfine.config.base`: the ``to_dict``/``from_dict`` base, the ``Literal`` option types.
- :mod:`memfine.config.routing`: :class:`RouteOptions` (group limit, weight scaling, capacity).
- :mod:`memfine.config.moe`: :class:`MoEConfig` (router, routed and shared experts; inherits
  :class:`RouteOptions`) and :class:`GatedActivation`.
- :mod:`memfine.config.model`: :class:`ChunkConfig` (MemFine chunking, MACT budget),
  :class:`ModelConfig`, :class:`TrainConfig`.
- :mod:`memfine.config.lora`: :class:`LoRAConfig` (split LoRA on the experts, the 4-bit base).

Every check raises ``ValueError`` naming the class, the field, what is allowed and the value
received, e.g. ``MoEConfig.top_k must be in [1, num_experts=8], got 9``.
"""

from memfine.config.base import (
    ACTIVATIONS_SAVING_OUTPUT,
    GATED_ACTIVATIONS,
    MAX_BIN,
    RECOMPUTE_MODES,
    Activation,
    AutocastDType,
    ConfigBase,
    DropPolicy,
    DType,
    ExpertsImpl,
    GateFn,
    GemmBackend,
    IndexBuilder,
    Recompute,
    RecomputeMode,
    ScoreFunc,
)
from memfine.config.blocks import config_block_rows, ladder_block_rows, shared_block_rows
from memfine.config.lora import LoRAConfig
from memfine.config.model import ChunkConfig, ModelConfig, TrainConfig
from memfine.config.moe import (
    BUDGET_BLOCK_DIVISORS,
    CPU_MAX_BLOCK_ROWS,
    CUDA_BACKWARD_BLOCK_BYTES,
    DEFAULT_BACKWARD_BLOCK_BYTES,
    DEVICE_MEMORY_BLOCK_DIVISOR,
    MIN_BLOCK_ROWS,
    GatedActivation,
    MoEConfig,
    backward_block_rows,
    block_row_bytes,
    budget_block_ladder,
    check_block_bytes,
    default_block_bytes,
)
from memfine.config.routing import RouteOptions

__all__ = [
    "ACTIVATIONS_SAVING_OUTPUT",
    "BUDGET_BLOCK_DIVISORS",
    "CPU_MAX_BLOCK_ROWS",
    "CUDA_BACKWARD_BLOCK_BYTES",
    "DEFAULT_BACKWARD_BLOCK_BYTES",
    "DEVICE_MEMORY_BLOCK_DIVISOR",
    "MIN_BLOCK_ROWS",
    "GATED_ACTIVATIONS",
    "MAX_BIN",
    "RECOMPUTE_MODES",
    "Activation",
    "AutocastDType",
    "ChunkConfig",
    "DType",
    "DropPolicy",
    "ExpertsImpl",
    "GateFn",
    "GatedActivation",
    "GemmBackend",
    "IndexBuilder",
    "LoRAConfig",
    "ModelConfig",
    "MoEConfig",
    "Recompute",
    "RecomputeMode",
    "RouteOptions",
    "ScoreFunc",
    "TrainConfig",
    "ConfigBase",
    "backward_block_rows",
    "block_row_bytes",
    "budget_block_ladder",
    "check_block_bytes",
    "config_block_rows",
    "default_block_bytes",
    "ladder_block_rows",
    "shared_block_rows",
]
