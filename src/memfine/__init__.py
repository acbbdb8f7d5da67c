"""memfine: memory-bounded Mixture-of-Experts training for PyTorch.

Public API re-exports only; importing memfine has no side effects.
"""

import warnings

with warnings.catch_warnings():  # restores the warning filters on exit
    # torch warns "Failed to initialize NumPy" at import where numpy is absent (a bare
    # install); memfine never uses numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.dispatch import RoutingIndex, build_routing_index
from memfine.experts import FusedExpertsFunction, run_experts
from memfine.nn import MoELayer, MoETransformerLM
from memfine.routing import RoutingResult, TopKRouter, load_balancing_loss, z_loss

__version__ = "0.2.0"

__all__ = [
    "ChunkConfig",
    "FusedExpertsFunction",
    "ModelConfig",
    "MoEConfig",
    "MoELayer",
    "MoETransformerLM",
    "RoutingIndex",
    "RoutingResult",
    "TopKRouter",
    "__version__",
    "build_routing_index",
    "load_balancing_loss",
    "run_experts",
    "z_loss",
]
