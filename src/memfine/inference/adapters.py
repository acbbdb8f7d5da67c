"""Exporting a LoRA fine-tune: its adapters alone, or the model with the adapters merged.

A ``memfine train --lora-rank`` run's checkpoint holds the trained parameters (the expert
adapters, and the routers or attention when they were trained) and a reference to the frozen
base, which loading reads (:mod:`memfine.artifacts.lora_base`).
:func:`export_adapters` writes the trained parameters only to ``adapters.safetensors``, with the
LoRA and model configs in its metadata; :func:`load_adapters` puts them on a model of the same
base (e.g. one loaded with :func:`memfine.inference.trained.load_safetensors`).
:func:`merged` folds the adapters into the base weights (W + s·(B·A)ᵀ per expert), giving a
plain model that :func:`memfine.inference.trained.export_safetensors` writes as any other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from memfine._optional import require
from memfine.config import ModelConfig
from memfine.config.lora import LoRAConfig
from memfine.inference.trained import Trained, atomic_write
from memfine.nn import MoETransformerLM
from memfine.nn.lora import adapter_state_dict, apply_lora, merge_model_lora_

ADAPTERS_FORMAT = "memfine-adapters-v1"
ADAPTERS_NAME = "adapters.safetensors"


def export_adapters(trained: Trained, path: str | os.PathLike[str]) -> list[Path]:
    """Write the trained parameters of a LoRA run to ``path`` (safetensors), atomically.

    Tensors: every parameter the run trained, under its name in the model
    (``blocks.0.moe.experts.lora_a_up`` (E, r, d), ``..lora_b_up`` (E, G, r), ``..lora_a_down``
    (E, r, n), ``..lora_b_down`` (E, d, r); router or attention weights when trained).
    Metadata: ``format`` (``memfine-adapters-v1``), ``lora_config`` and ``model_config`` (JSON),
    ``dtype``, ``step``.

    Returns:
        ``[path]``.

    Raises:
        ValueError: when the run has no LoRA adapters.
        ImportError: naming the extra when ``safetensors`` is missing (nothing is written).
    """
    config = trained.config
    if config.lora is None:
        raise ValueError("the run has no LoRA adapters (it was not trained with --lora-rank)")
    save_file = require("safetensors.torch").save_file
    path = Path(path)
    tensors = {k: v.cpu().contiguous() for k, v in adapter_state_dict(trained.model).items()}
    metadata = {"format": ADAPTERS_FORMAT, "lora_config": json.dumps(config.lora.to_dict()),
                "model_config": json.dumps(config.model.to_dict()), "dtype": config.dtype,
                "step": str(trained.step)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return [path]


def load_adapters(model: MoETransformerLM, path: str | os.PathLike[str]) -> LoRAConfig:
    """Give ``model`` the adapters (and trained weights) of an :func:`export_adapters` file.

    Args:
        model: a model without adapters, of the file's model config (its base weights are the
            ones the adapters were trained on; they are not checked).
        path: the adapters file.

    Returns:
        The file's :class:`LoRAConfig`; ``model`` now holds adapters with the file's values
        (and its trained router or attention weights), frozen as in training.

    Raises:
        ValueError: when the file is not a memfine adapters file, or its model config or tensor
            names do not fit ``model``.
    """
    safe_open = require("safetensors").safe_open
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != ADAPTERS_FORMAT:
            raise ValueError(f"{str(path)!r} is not a {ADAPTERS_FORMAT} file")
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    saved = ModelConfig.from_dict(json.loads(metadata["model_config"]))
    if saved != model.config:
        raise ValueError(f"{str(path)!r} adapts another model: it differs in "
                         f"{saved.differing_fields(model.config)}")
    lora = LoRAConfig.from_dict(json.loads(metadata["lora_config"]))
    apply_lora(model, lora)
    own = dict(model.named_parameters())
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(f"{str(path)!r} holds tensors this model does not have: {unknown[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)
    return lora


def merged(trained: Trained) -> Trained:
    """The run's model with its adapters folded into the base weights, as a plain model.

    The result's config has ``lora=None``; its logits equal the adapter model's up to rounding.
    ``trained`` is changed in place (its experts are replaced).

    Raises:
        ValueError: when the run has no LoRA adapters.
    """
    if trained.config.lora is None:
        raise ValueError("the run has no LoRA adapters (it was not trained with --lora-rank)")
    merge_model_lora_(trained.model)
    return dataclasses.replace(trained, config=dataclasses.replace(trained.config, lora=None))
