"""PEFT LoRA on the experts' 3-D weights (``target_parameters``), run as split LoRA by memfine.

PEFT's ``lora.ParamWrapper`` adapts a parameter by registering a parametrization on the experts
module for the duration of its forward: one adapter becomes ``_LoraFactorsProxy`` (W + s·B·A as
one ``baddbmm``), several adapters or a low-precision weight ``_LoraParameterProxy`` (W + ΔW
with ΔW built first). Reading the parametrized weight materialises the whole (E, d_out, d_in)
update, its gradient and the products.

memfine needs no call of its own for this: :func:`parametrized_lora` reads PEFT's factors off
the parametrization at call time (the experts function receives the module), the experts run on
the original weights plus x·W + s·(x·Aᵀ)·Bᵀ on the expert-grouped rows
(:mod:`memfine.lora.adapters`), and the PEFT wrappers of that call (found on the call stack)
become :class:`MemfineParamWrapper` (:func:`split_lora`), so later calls skip PEFT's
registration, whose consistency check evaluates W + s·B·A once per wrapper and forward.
A :class:`MemfineParamWrapper` (a subclass: same parameters, same ``state_dict`` keys, and
PEFT's class name ``ParamWrapper``, by which PEFT finds a weight's wrapper to add an adapter to)
hands its adapter to the experts module instead of parametrizing. PEFT's own
``save_pretrained``, ``PeftModel.from_pretrained``, ``add_adapter``, ``load_adapter``,
``set_adapter``, ``delete_adapter``, merge / unmerge, ``merge_and_unload`` and
``disable_adapter`` keep working as PEFT implements them. What split LoRA cannot honour runs
PEFT's dense W + ΔW, exactly, with one warning per module naming the reason: several active
adapters, a low-precision (float8) weight, another parametrization, or an experts module on
memfine's plain path. PEFT itself refuses DoRA, ``lora_dropout``, ``lora_bias`` and
mixed-adapter batches on ``target_parameters``.

PEFT's layout (``ParamWrapper.get_delta_factors``): ΔW = s·lhs·rhs per expert, with lhs = B
(E, d_out, r) and rhs = A (E, r, d_in) for modules that store (E, d_out, d_in)
(``is_transposed=False``), and lhs = Aᵀ, rhs = Bᵀ for (E, d_in, d_out). Both are views of
``lora_A.weight`` (E·r, d_in) and ``lora_B.weight`` (d_out, r·E), never copies (PEFT casts
them to the base weight's dtype when they differ).

Legend: E experts, R = r, D = d, N = n, G = 2n (gated) or n.
Reference: PEFT ``tuners/lora/layer.py`` (``ParamWrapper``); Hu et al. 2021 (LoRA).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn

from memfine._optional import require
from memfine.lora.adapters import ExpertLoRA

LORA_ATTRIBUTE = "_memfine_lora"
_WARNED_ATTRIBUTE = "_memfine_peft_dense_warned"  # set on an experts module once warned
_UP_NAMES = ("gate_up_proj", "up_proj")
_DOWN_NAMES = ("down_proj",)
_PEFT_LAYER = "peft.tuners.lora.layer"
_PEFT_NAME = "ParamWrapper"  # PEFT's class, and the name memfine's subclass keeps
_STACK_DEPTH = 64  # frames searched for the PEFT wrappers of a call
# Set on a wrapper converted during a forward: it splits from the next forward on, and until
# then runs PEFT's path, so that an activation-checkpoint recompute of the converting forward
# (in backward) saves what that forward saved.
_SPLIT_FROM_NEXT_FORWARD = "_memfine_split_from_next_forward"

Adapters = tuple[torch.Tensor, torch.Tensor, float]  # A (E, r, d_in), B (E, d_out, r), s


def split_factors(lhs: torch.Tensor, rhs: torch.Tensor, scaling: float,
                  transposed: bool) -> Adapters:
    """PEFT's ΔW = s·lhs·rhs factors as (A (E, r, d_in), B (E, d_out, r), s), as views.

    Args:
        lhs: (E, P, r) left factor (``ParamWrapper.get_delta_factors``).
        rhs: (E, r, Q) right factor; the parameter is (E, P, Q).
        scaling: s (α / r, or α / √r with rsLoRA).
        transposed: the module stores (E, d_in, d_out) (``is_transposed``); otherwise
            (E, d_out, d_in).
    """
    if transposed:
        return lhs.transpose(1, 2), rhs.transpose(1, 2), float(scaling)
    return rhs, lhs, float(scaling)


def _peft_adapters(wrapper: Any, adapter: str) -> Adapters:
    """(A, B, s) of ``adapter`` on ``wrapper``, from PEFT's own factors."""
    transposed = bool(getattr(wrapper.get_base_layer(), "is_transposed", False))
    lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
    return split_factors(lhs, rhs, scaling, transposed)


def _expert_lora(module: nn.Module, up: Adapters | None, down: Adapters | None) -> ExpertLoRA:
    scales = {p[2] for p in (up, down) if p is not None}
    if len(scales) != 1:
        raise ValueError(f"memfine's split LoRA needs one scale for the up and down adapters of "
                         f"{type(module).__name__}, got {sorted(scales)}")
    return ExpertLoRA(a_up_ERD=up[0] if up else None, b_up_EGR=up[1] if up else None,
                      a_down_ERN=down[0] if down else None, b_down_EDR=down[1] if down else None,
                      scale=scales.pop())


def pending_lora(module: nn.Module) -> ExpertLoRA | None:
    """The adapters a :class:`MemfineParamWrapper` handed to ``module`` for this call, or None."""
    pending = module.__dict__.get(LORA_ATTRIBUTE)
    if not pending:
        return None
    return _expert_lora(module, pending.get("up"), pending.get("down"))


def _is_peft(obj: object, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__ == _PEFT_LAYER


def _warn_dense(module: nn.Module, name: str, reason: str) -> None:
    if module.__dict__.get(_WARNED_ATTRIBUTE):
        return
    module.__dict__[_WARNED_ATTRIBUTE] = True
    warnings.warn(f"memfine runs PEFT's dense W + ΔW on {type(module).__name__}.{name} "
                  f"({reason}); split LoRA needs one active adapter on a floating-point weight "
                  f"and memfine's fused path", UserWarning, stacklevel=3)


def parametrized_lora(module: nn.Module, fused: bool, plain_reason: str = ""
                      ) -> tuple[ExpertLoRA | None, frozenset[str]]:
    """PEFT's LoRA parametrizations on ``module``'s expert weights, as split adapters.

    Reads ``module.parametrizations`` (registered by PEFT's ``ParamWrapper`` for its forward):
    a weight whose only parametrization is PEFT's ``_LoraFactorsProxy`` is split (its factors
    become adapters, its original is read); any other parametrization is left to be read
    parametrized (PEFT's dense W + ΔW, exact) with one warning per module. The PEFT wrappers of
    this call are then converted (:func:`convert_callers`) so later calls hand their adapters
    over directly.

    Args:
        module: a transformers experts module.
        fused: memfine runs ``module`` on its fused path (split LoRA needs it).
        plain_reason: why it takes the plain path (named in the warning).

    Returns:
        (the adapters or None, the names whose unparametrized original is to be read).
    """
    parametrizations = module.__dict__.get("_modules", {}).get("parametrizations")
    if parametrizations is None:
        return None, frozenset()
    found: dict[str, Adapters] = {}
    transposed = bool(getattr(module, "is_transposed", False))
    for name in (*_UP_NAMES, *_DOWN_NAMES):
        if name not in parametrizations:
            continue
        chain = list(parametrizations[name])
        if not any(_is_peft(p, "_LoraFactorsProxy") or _is_peft(p, "_LoraParameterProxy")
                   for p in chain):
            continue  # not PEFT's: read parametrized, as any other module would
        if not fused:
            _warn_dense(module, name, f"memfine's plain path: {plain_reason}")
        elif len(chain) == 1 and _is_peft(chain[0], "_LoraFactorsProxy"):
            proxy = chain[0]
            found[name] = split_factors(proxy.lhs, proxy.rhs, proxy.scaling, transposed)
        elif any(_is_peft(p, "_LoraParameterProxy") for p in chain):
            _warn_dense(module, name, "PEFT summed the update of several active adapters or "
                        "upcasts a low-precision weight")
        else:
            _warn_dense(module, name, "a parametrization other than PEFT's LoRA factors")
    if not found:
        return None, frozenset()
    up = next((found[n] for n in _UP_NAMES if n in found), None)
    down = next((found[n] for n in _DOWN_NAMES if n in found), None)
    lora = _expert_lora(module, up, down)
    convert_callers(module)
    return lora, frozenset(found)


def convert_callers(module: nn.Module) -> int:
    """Make the PEFT ``ParamWrapper`` frames on the call stack whose base is ``module`` split.

    The wrappers that are running ``module`` now (nested, one per adapted weight) become
    :class:`MemfineParamWrapper` for later forwards; the running call is not affected, nor a
    recompute of it in backward (activation checkpointing: a recompute must save what the
    forward saved, so a converted wrapper keeps PEFT's path until a forward starts outside
    backward). Nothing happens while ``torch.compile`` traces. Returns the number converted.
    """
    layer = sys.modules.get(_PEFT_LAYER)
    if layer is None or torch.compiler.is_compiling():
        return 0
    cls, converted = wrapper_class(), 0
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            break
        obj: Any = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if (type(obj) is layer.ParamWrapper and obj.parameter_name in (*_UP_NAMES, *_DOWN_NAMES)
                and obj.get_base_layer() is module):
            obj.__class__ = cls
            obj.__dict__[_SPLIT_FROM_NEXT_FORWARD] = True
            converted += 1
        frame = frame.f_back
    return converted


@contextlib.contextmanager
def _handed_over(module: nn.Module, which: str, adapters: Adapters) -> Iterator[None]:
    pending = module.__dict__.setdefault(LORA_ATTRIBUTE, {})
    pending[which] = adapters
    try:
        yield
    finally:
        pending.pop(which, None)


def runs_memfine_fused(module: nn.Module) -> bool:
    """True when ``module`` runs memfine's experts function on the fused path.

    Asks the function registered for the module's ``_experts_implementation`` (memfine's
    binds ``memfine_runs_fused``; any other function answers False).
    """
    name = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if name is None:
        return False
    fn = require("transformers.integrations.moe").ExpertsInterface().get(name)
    runs_fused = getattr(fn, "memfine_runs_fused", None)
    return bool(runs_fused(module)) if runs_fused is not None else False


@functools.cache
def wrapper_class() -> type:
    """:class:`MemfineParamWrapper`, built on first use (PEFT is imported lazily)."""
    layer = require(_PEFT_LAYER)

    class MemfineParamWrapper(layer.ParamWrapper):  # type: ignore[name-defined]
        """PEFT's ``ParamWrapper`` whose forward hands its adapter to memfine's experts."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            """Split LoRA through memfine, or PEFT's own forward where that does not apply."""
            base = self.get_base_layer()
            active = [a for a in self.active_adapters if a in self.lora_A]
            which = ("up" if self.parameter_name in _UP_NAMES
                     else "down" if self.parameter_name in _DOWN_NAMES else None)
            if self.__dict__.get(_SPLIT_FROM_NEXT_FORWARD):
                if torch._C._current_graph_task_id() != -1:  # a recompute, in backward
                    return super().forward(x, *args, **kwargs)
                del self.__dict__[_SPLIT_FROM_NEXT_FORWARD]
            if (which is None or len(active) != 1 or self.disable_adapters or self.merged
                    or kwargs.get("adapter_names") is not None or not runs_memfine_fused(base)):
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            with _handed_over(base, which, _peft_adapters(self, active[0])):
                return self.base_layer(x, *args, **kwargs)

    # PEFT finds the wrapper of a weight by its class name ("ParamWrapper": add_adapter,
    # load_adapter and nesting reuse it), so the subclass keeps that name; it is told apart by
    # its module. Pickled by module and name (__getattr__ below).
    MemfineParamWrapper.__module__ = __name__
    MemfineParamWrapper.__name__ = MemfineParamWrapper.__qualname__ = _PEFT_NAME
    return MemfineParamWrapper


def is_split_wrapper(module: object) -> bool:
    """True when ``module`` is a PEFT wrapper that memfine converted (:func:`split_lora`)."""
    cls = type(module)
    return cls.__module__ == __name__ and cls.__name__ == _PEFT_NAME


def __getattr__(name: str) -> Any:
    """``MemfineParamWrapper`` (built on first access; pickled wrappers load by name)."""
    if name in ("MemfineParamWrapper", _PEFT_NAME):
        return wrapper_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def split_lora(model: nn.Module) -> int:
    """Make every PEFT ``ParamWrapper`` on an experts weight run memfine's split LoRA now.

    Not needed: the experts function converts the wrappers it is called through on the first
    call (:func:`parametrized_lora`); this does it ahead of time, e.g. so that the first
    forward skips PEFT's parametrization. In place and idempotent; wrappers of modules that do
    not run memfine's fused path keep PEFT's behaviour at run time.

    Returns:
        The number of wrappers converted (0 when none, or all were converted before).

    Raises:
        ImportError: when peft is not installed (``pip install 'memfine[hf]'``).
    """
    layer = require(_PEFT_LAYER)
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
