"""A LoRA run's step prediction: gradients and AdamW state of the trained parameters only."""

from __future__ import annotations

import dataclasses

import torch

from memfine.config.lora import LoRAConfig
from memfine.memory.layer import moe_layer_memory
from memfine.memory.lora import lora_layer_memory
from memfine.nn import MoETransformerLM
from memfine.nn.lora import apply_lora
from memfine.reports.memory_log import ADAM_MOMENTS, num_parameters, predicted_run_bytes
from memfine.train import preset


def _trained(config) -> tuple[int, int]:
    """(all, trained) parameters of the real model (not meta), counted by hand."""
    model = MoETransformerLM(config.model)
    if config.lora is not None:
        apply_lora(model, config.lora)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def test_lora_prediction_counts_only_trained_gradients_and_moments() -> None:
    full = preset("tiny")
    for lora in (LoRAConfig(rank=4), LoRAConfig(rank=2, train_router=True, train_attention=True)):
        config = dataclasses.replace(full, lora=lora)
        total, trained = _trained(config)
        assert num_parameters(config) == total
        assert num_parameters(config, trainable_only=True) == trained < total
        dt, tokens = torch.float32.itemsize, 256
        base = num_parameters(full)
        layers = config.model.num_layers
        moe = config.model.moe
        plain = moe_layer_memory(moe, tokens, dt)
        adapted = lora_layer_memory(moe, lora, tokens, dt)
        # static: every parameter once, a gradient and two moments for the trained ones only
        assert predicted_run_bytes(full, base, tokens) == (
            (2 + ADAM_MOMENTS) * base * dt + layers * plain.saved_bytes
            + plain.peak_bytes - plain.saved_bytes)
        assert predicted_run_bytes(config, total, tokens) == (
            (total + (1 + ADAM_MOMENTS) * trained) * dt + layers * adapted.saved_bytes
            + adapted.peak_bytes - adapted.saved_bytes)
