"""Loading a checkpoint's states into a model and optimizer: either form, at any layout.

A one-file checkpoint or a DCP directory (:mod:`memfine.artifacts.checkpoint`), written on one
process or at any mesh layout, loads into a whole or a sharded model; a LoRA checkpoint's frozen
base is loaded first (:mod:`memfine.artifacts.lora_base`), then its trained tensors.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from memfine.artifacts.checkpoint import LoRABaseError, set_rng_state
from memfine.artifacts.lora_base import load_base_, trainable_state


def load_states(payload: dict[str, Any], model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, *, sharded: bool) -> None:
    """Load a checkpoint's model and optimizer states, whatever form and layout wrote them.

    Args:
        payload: from :func:`memfine.artifacts.checkpoint.read_checkpoint`.
        model: the model (sharded with FSDP2 and expert parallelism, or whole).
        optimizer: its optimizer.
        sharded: whether ``model`` is sharded (its state dict holds DTensors).

    Raises:
        RuntimeError, KeyError, ValueError: when the states do not fit the model.

    Side effects: with a DCP payload, every rank reads the shards it needs (a collective when
    sharded).
    """
    lora = "base" in payload
    if lora and not sharded:  # a sharded model got its frozen base before sharding
        _load_lora_base(payload, model)
    if "sharded_path" in payload:
        model_state, optim_state = get_state_dict(model, optimizer)
        if lora:
            model_state = trainable_state(model, model_state)
        with warnings.catch_warnings():  # one process reading a sharded checkpoint is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_state, "optimizer": optim_state},
                     checkpoint_id=payload["sharded_path"])
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optim_state, options=StateDictOptions(strict=not lora))
    elif not sharded:
        _load_model(payload, model, base=False)
        optimizer.load_state_dict(payload["optimizer"])
    else:  # one file of full tensors into a sharded model: every rank keeps its shards
        set_state_dict(model, optimizer, model_state_dict=payload["model"],
                       optim_state_dict=_named_optimizer_state(payload["optimizer"], model,
                                                               optimizer),
                       options=StateDictOptions(full_state_dict=True, strict=not lora))


def restore(payload: dict[str, Any], model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
            *, sharded: bool) -> int:
    """Load a checkpoint payload into model, optimizer, scheduler and the RNGs (resume).

    Either form (one file, or a DCP directory written at any mesh layout) loads into a whole or
    a sharded model (:func:`load_states`).

    Args:
        payload: from :func:`memfine.artifacts.checkpoint.read_checkpoint`, with ``path``
            (the checkpoint, for messages).
        model: the model built from the checkpoint's config (sharded or whole).
        optimizer: its optimizer.
        scheduler: its LR scheduler.
        sharded: whether ``model`` is sharded (its state dict holds DTensors).

    Returns:
        The checkpoint's completed steps.

    Raises:
        ValueError: naming the checkpoint when the states do not fit the model;
            :class:`LoRABaseError` naming it when its LoRA base run is gone or changed.
    """
    try:
        load_states(payload, model, optimizer, sharded=sharded)
        scheduler.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
    except LoRABaseError as err:
        raise LoRABaseError(f"checkpoint {payload['path']!r}: {err}") from err
    except (RuntimeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {payload['path']!r} does not match its config "
                         f"({type(err).__name__}: {str(err).splitlines()[0]})") from err
    return int(payload["step"])


def load_model_state(payload: dict[str, Any], model: torch.nn.Module, *,
                     base: bool = True) -> None:
    """Load only a checkpoint's model state into a whole (unsharded) model, either form.

    Args:
        payload: from :func:`memfine.artifacts.checkpoint.read_checkpoint`.
        model: the whole model (e.g. before the parallel hooks shard it).
        base: for a LoRA checkpoint, also load its frozen base (False: the trained state
            alone).

    Raises:
        RuntimeError, KeyError, ValueError: when the state does not fit the model.
    """
    if "sharded_path" not in payload:
        _load_model(payload, model, base=base)
        return
    lora = "base" in payload
    if lora and base:  # adapter-only: the frozen base first, then the trained tensors from DCP
        _load_lora_base(payload, model)
    state = model.state_dict() if not lora else trainable_state(model)
    with warnings.catch_warnings():  # one process reading a sharded checkpoint is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=payload["sharded_path"])
    model.load_state_dict(state, strict=not lora)


def _load_lora_base(payload: dict[str, Any], model: torch.nn.Module) -> None:
    """Load the frozen base of a LoRA payload (either form) into a whole model.

    The base bytes the run kept beside its checkpoint (``lora_base/``) come first; else the base
    run's own checkpoint, checked by its SHA-256.
    """
    where = Path(payload["path"]).parent if "path" in payload else None
    load_base_(payload["base"], payload["config"], model, where=where)


def _load_model(payload: dict[str, Any], model: torch.nn.Module, *, base: bool = True) -> None:
    """The model state of a one-file payload; a LoRA one's frozen base from its ``base`` first.

    ``base=False`` loads a LoRA payload's trained state alone (the frozen weights stay as
    built): enough to export the adapters, which never depend on the base.

    Raises:
        RuntimeError, ValueError: when the state does not fit, or the base changed or is gone.
    """
    if "base" not in payload:
        model.load_state_dict(payload["model"])
        return
    if base:
        _load_lora_base(payload, model)
    unexpected = model.load_state_dict(payload["model"], strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(f"unexpected keys in the adapter state: {unexpected[:3]}")


def _named_optimizer_state(state: dict[str, Any], model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` (keyed by parameter position) keyed by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {fqns[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]}
                             for g in state["param_groups"]]}
