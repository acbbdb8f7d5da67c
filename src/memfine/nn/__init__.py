"""Modules: the MoE layer, its experts, and a small MoE transformer language model."""

from memfine.nn.experts import GroupedExperts
from memfine.nn.model import LMOutput, MoETransformerLM
from memfine.nn.moe import MoEAux, MoELayer

__all__ = ["GroupedExperts", "LMOutput", "MoEAux", "MoELayer", "MoETransformerLM"]
