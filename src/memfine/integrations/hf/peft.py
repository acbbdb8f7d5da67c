"""PEFT LoRA on the experts' 3-D weights (``target_parameters``), run as split LoRA by memfine.

PEFT's ``lora.ParamWrapper`` adapts a parameter by re-parametrising it as W + s·B·A for every
expert on every forward (the whole (E, d_out, d_in) update, its gradient and the products are
materialised). :func:`split_lora` turns each such wrapper of a transformers experts module that
runs memfine's fused path into a :class:`MemfineParamWrapper` (a subclass, same parameters, same
``state_dict`` keys): its forward hands the adapters to the experts module instead, and memfine
computes x·W + s·(x·Aᵀ)·Bᵀ on the expert-grouped rows (:mod:`memfine.ops.fused.lora`). PEFT's own
``save_pretrained``, ``PeftModel.from_pretrained``, ``merge_and_unload``, ``disable_adapter`` and
the merged state keep working as PEFT implements them (merged or disabled adapters, several
active adapters and mixed-adapter batches fall back to PEFT's own forward).

PEFT's layout (``ParamWrapper.update_layer``/``get_delta_weight``): for a 3-D parameter with E
experts, ``lora_A.weight`` is (E·r, d_in), read as A (E, r, d_in), and ``lora_B.weight`` is
(d_out, r·E), read as B[e] = weight.view(d_out, r, E)[:, :, e]; d_in / d_out are the
projection's input / output features (PEFT swaps the stored order for ``is_transposed=False``
modules). Both are views here, never copies.

Legend: E experts, R = r, D = d, N = n, G = 2n (gated) or n.
Reference: PEFT ``tuners/lora/layer.py`` (``ParamWrapper``); Hu et al. 2021 (LoRA).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfine._optional import require
from memfine.ops.fused.lora import ExpertLoRA

LORA_ATTRIBUTE = "_memfine_lora"
_UP_NAMES = ("gate_up_proj", "up_proj")
_DOWN_NAMES = ("down_proj",)


def _peft_adapters(wrapper: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A (E, r, d_in), B (E, d_out, r), s) of ``adapter`` on ``wrapper``, as views."""
    E = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight  # (E·r, d_in)
    b = wrapper.lora_B[adapter].weight  # (d_out, r·E)
    r = a.shape[0] // E
    return (a.view(E, r, a.shape[1]), b.view(b.shape[0], r, E).permute(2, 0, 1),
            float(wrapper.scaling[adapter]))


def pending_lora(module: nn.Module) -> ExpertLoRA | None:
    """The adapters a :class:`MemfineParamWrapper` handed to ``module`` for this call, or None."""
    pending = module.__dict__.get(LORA_ATTRIBUTE)
    if not pending:
        return None
    up, down = pending.get("up"), pending.get("down")
    scales = {p[2] for p in (up, down) if p is not None}
    if len(scales) != 1:
        raise ValueError(f"memfine's split LoRA needs one scale for the up and down adapters of "
                         f"{type(module).__name__}, got {sorted(scales)}")
    return ExpertLoRA(a_up_ERD=up[0] if up else None, b_up_EGR=up[1] if up else None,
                      a_down_ERN=down[0] if down else None, b_down_EDR=down[1] if down else None,
                      scale=scales.pop())


@contextlib.contextmanager
def _handed_over(module: nn.Module, which: str,
                 adapters: tuple[torch.Tensor, torch.Tensor, float]) -> Iterator[None]:
    pending = module.__dict__.setdefault(LORA_ATTRIBUTE, {})
    pending[which] = adapters
    try:
        yield
    finally:
        pending.pop(which, None)


def runs_memfine_fused(module: nn.Module) -> bool:
    """True when ``module`` runs memfine's experts function on the fused path."""
    from memfine.integrations.transformers import (
        _module_config,
        require_transformers,
        resolve_plan,
    )

    name = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if name is None:
        return False
    fn = require_transformers().ExpertsInterface().get(name)
    config = getattr(fn, "memfine_config", None)
    if config is None:
        return False
    try:
        return resolve_plan(module, _module_config(module, config).impl).path == "fused"
    except ValueError:
        return False


@functools.cache
def wrapper_class() -> type:
    """:class:`MemfineParamWrapper`, built on first use (PEFT is imported lazily)."""
    layer = require("peft.tuners.lora.layer")

    class MemfineParamWrapper(layer.ParamWrapper):  # type: ignore[name-defined]
        """PEFT's ``ParamWrapper`` whose forward hands its adapter to memfine's experts."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            """Split LoRA through memfine, or PEFT's own forward where that does not apply."""
            base = self.get_base_layer()
            active = [a for a in self.active_adapters if a in self.lora_A]
            which = ("up" if self.parameter_name in _UP_NAMES
                     else "down" if self.parameter_name in _DOWN_NAMES else None)
            if (which is None or len(active) != 1 or self.disable_adapters or self.merged
                    or kwargs.get("adapter_names") is not None or not runs_memfine_fused(base)):
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            with _handed_over(base, which, _peft_adapters(self, active[0])):
                return self.base_layer(x, *args, **kwargs)

    MemfineParamWrapper.__module__ = __name__
    return MemfineParamWrapper


def split_lora(model: nn.Module) -> int:
    """Make every PEFT ``ParamWrapper`` on an experts weight run memfine's split LoRA.

    In place and idempotent; call it after ``peft.get_peft_model`` or
    ``PeftModel.from_pretrained`` (:func:`get_peft_model` does both steps). Wrappers of modules
    that do not run memfine's fused path keep PEFT's behaviour at run time.

    Returns:
        The number of wrappers converted (0 when none, or all were converted before).

    Raises:
        ImportError: when peft is not installed (``pip install 'memfine[hf]'``).
    """
    layer = require("peft.tuners.lora.layer")
    cls = wrapper_class()
    converted = 0
    for module in model.modules():
        if type(module) is layer.ParamWrapper and (module.parameter_name in _UP_NAMES
                                                   or module.parameter_name in _DOWN_NAMES):
            module.__class__ = cls
            converted += 1
    return converted


def get_peft_model(model: nn.Module, config: Any, **kwargs: Any) -> Any:
    """``peft.get_peft_model(model, config, **kwargs)``, then :func:`split_lora` on it."""
    peft = require("peft")
    peft_model = peft.get_peft_model(model, config, **kwargs)
    split_lora(peft_model)
    return peft_model
