"""Loading a checkpoint's weights into a model of a given architecture.

Behind ``memfine train --init-from`` (:func:`load_weights`) and a LoRA run's frozen base
(:mod:`memfine.artifacts.lora_base`); :mod:`memfine.inference.trained` rebuilds a run's model
with :func:`language_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from memfine.artifacts.checkpoint import LoRABaseError, find_checkpoint, read_checkpoint
from memfine.artifacts.finite import check_finite_model
from memfine.artifacts.restore import load_model_state
from memfine.config import ModelConfig, TrainConfig
from memfine.nn import MoETransformerLM
from memfine.nn.lora import apply_lora, merge_model_lora_

ARCHITECTURE_FIELDS = ("vocab_size", "num_layers", "num_heads", "rope_theta", "norm_eps",
                       "moe.hidden_size", "moe.intermediate_size", "moe.num_experts",
                       "moe.top_k", "moe.score_func", "moe.renormalize", "moe.activation",
                       "moe.n_group", "moe.topk_group", "moe.routed_scaling_factor",
                       "moe.num_shared_experts", "moe.shared_intermediate_size",
                       "moe.shared_expert_gate")
"""The :class:`ModelConfig` fields (dotted) that define what a model's weights compute.

A run started from another run's weights (``init_from``) keeps them; the rest of the model's
config (chunking and memory budget, recompute, expert kernels, capacity, loss coefficients,
``max_seq_len``: RoPE has no weights) is a setting of the new run.
"""


def architecture_differences(source: ModelConfig, model: ModelConfig
                             ) -> list[tuple[str, object, object]]:
    """``(field, source's value, model's value)`` per differing :data:`ARCHITECTURE_FIELDS`."""
    out: list[tuple[str, object, object]] = []
    for path in ARCHITECTURE_FIELDS:
        a, b = source, model
        for key in path.split("."):
            a, b = getattr(a, key), getattr(b, key)
        if a != b:
            out.append((path, a, b))
    return out


def load_weights(model: MoETransformerLM, model_config: ModelConfig,
                 run_dir: str | os.PathLike[str]) -> None:
    """Load the weights of ``run_dir``'s newest checkpoint into ``model`` (fine-tuning).

    Either form: ``checkpoint.pt`` or a sharded ``checkpoint.dcp/``; the optimizer state and
    schedule are not read (``memfine train --init-from``). The checkpoint of a LoRA fine-tune
    gives its base weights with the adapters folded in (W + s·(B·A)ᵀ per expert).

    Args:
        model: a whole (unsharded) model built from ``model_config``.
        model_config: the model of the new run; its :data:`ARCHITECTURE_FIELDS` must equal
            the checkpoint's (chunking, kernels and the other settings may differ).
        run_dir: the run directory of the checkpoint.

    Raises:
        ValueError: naming ``run_dir`` when its checkpoint is missing or corrupt, or holds
            another model (the message lists the fields that differ), or holds NaN/±inf
            weights;
            :class:`memfine.artifacts.checkpoint.LoRABaseError` naming the checkpoint when it
            holds LoRA adapters whose base run is gone or changed.
    """
    load_checkpoint_weights(model, model_config, find_checkpoint(run_dir),
                            name=f"--init-from {str(run_dir)!r}")


def load_checkpoint_weights(model: MoETransformerLM, model_config: ModelConfig,
                            path: str | os.PathLike[str], *, name: str | None = None) -> None:
    """Load the weights of the checkpoint ``path`` (a file or DCP directory) into ``model``.

    As :func:`load_weights`, for one checkpoint rather than a run directory's newest (e.g. the
    base a LoRA run keeps, :mod:`memfine.artifacts.lora_base`); ``name`` is what messages call
    it (default: ``checkpoint 'path'``).

    Raises:
        ValueError, LoRABaseError: as :func:`load_weights`.
    """
    path = Path(path)
    payload = read_checkpoint(path)
    source = TrainConfig.from_dict(payload["config"])
    differ = architecture_differences(source.model, model_config)
    if differ:
        raise ValueError(f"{name or f'checkpoint {str(path)!r}'}: its model differs in "
                         f"{', '.join(f'{p} ({a!r} there, {b!r} here)' for p, a, b in differ)}; "
                         f"the model's architecture must be the checkpoint's")
    with torch.no_grad():
        if source.lora is None:
            load_model_state(payload, model)
            check_finite_model(model, str(path))
            return
        adapted = language_model(source)  # a LoRA run: its adapters merged into the base
        try:
            load_model_state(payload, adapted)
        except LoRABaseError as err:  # "its LoRA base ...": the checkpoint it speaks of
            raise LoRABaseError(f"checkpoint {str(path)!r}: {err}") from err
        check_finite_model(adapted, str(path))
        merge_model_lora_(adapted)
        model.load_state_dict(adapted.state_dict())


def language_model(config: TrainConfig) -> MoETransformerLM:
    """The (CPU, fp32) model of a run's config, with expert adapters when ``config.lora`` is set.

    The adapters' initial values are drawn without touching the global RNG (they are meant to
    be overwritten by a checkpoint's).
    """
    model = MoETransformerLM(config.model)
    if config.lora is not None:
        with torch.random.fork_rng(devices=[]):
            apply_lora(model, config.lora)
    return model
