"""Recognising a transformers experts module's custom gate as a memfine ``GatedActivation``.

transformers' experts modules compute A = ``_apply_gate(H)``; the default is
``act_fn(H[:, :n]) * H[:, n:]``, and some models override it: GPT-OSS (interleaved gate/up,
gate clamped from above at ``limit``, up clamped to ±limit, ``(up + 1)·g·σ(α·g)``),
MiniMax-M3-VL and OpenAI's privacy filter (the same on halves), DeepSeek-V4 / HY-V4 /
GLM-5-Next (SiLU on the clamped halves), Beam (SwiGLU computed in fp32). A candidate
:class:`GatedActivation` is built from the module's ``alpha``/``swiglu_alpha`` and
``limit``/``swiglu_limit`` attributes and its ``act_fn``, and accepted only when it reproduces
the module's own ``_apply_gate`` bit for bit on fp32 and bf16 probes (values on both sides of
the clamp). A gate no candidate reproduces stays on the plain path, which calls the module's
function (exact, but it saves what autograd saves); a warning per class says so and where to add
the gate.

Adding a class whose gate a :class:`GatedActivation` can express (docs/extending.md): name its
attributes in :data:`ALPHA_ATTRIBUTES` / :data:`LIMIT_ATTRIBUTES` (the plan cache of
:mod:`memfine.hf.layout` reads the same names), or yield the form from
:func:`_candidates`; then a test that ``plan_experts`` picks the fused path with that spec.

Legend: S probe rows, N = n, G = 2n.
Reference: transformers 5.24 ``integrations/moe.py`` (``_default_apply_gate``) and the models'
``_apply_gate`` overrides named above (our reading of their code).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memfine.activations import apply_activation
from memfine.config import GatedActivation

_PROBE_ROWS, _PROBE_N = 8, 6
ALPHA_ATTRIBUTES = ("alpha", "swiglu_alpha")
"""Attributes read as the SiLU's α (GPT-OSS: ``alpha``), first finite one wins."""
LIMIT_ATTRIBUTES = ("limit", "swiglu_limit")
"""Attributes read as the clamp limit (GPT-OSS: ``limit``; DeepSeek-V4: ``swiglu_limit``)."""
GATE_ATTRIBUTES = ALPHA_ATTRIBUTES + LIMIT_ATTRIBUTES
"""Every attribute :func:`match_gate` reads (a module's plan is rebuilt when one changes)."""
_WARNED: set[type] = set()  # experts classes already warned about (one warning per class)


def _attr_float(module: nn.Module, *names: str) -> float | None:
    """The first of ``names`` that is a finite number on the module, as a float, else None."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return float(value)
    return None


def _candidates(module: nn.Module, gate_fn: str | None) -> Iterator[GatedActivation]:
    """GatedActivations the module's attributes suggest, most specific first."""
    alpha = _attr_float(module, *ALPHA_ATTRIBUTES)
    limit = _attr_float(module, *LIMIT_ATTRIBUTES)
    limit = limit if limit is not None and limit > 0 else None
    for interleaved in (False, True):
        for upcast in (False, True):
            if alpha is not None and alpha > 0:
                yield GatedActivation(alpha=alpha, limit=limit, up_offset=1.0,
                                      interleaved=interleaved, upcast=upcast)
            for fn in dict.fromkeys((gate_fn or "silu", "silu")):
                yield GatedActivation(gate_fn=fn, limit=limit,  # type: ignore[arg-type]
                                      interleaved=interleaved, upcast=upcast)


def _probe(scale: float) -> torch.Tensor:
    """(S, G) fp32 probe spanning ±2·scale, from a private generator (global RNG untouched)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(_PROBE_ROWS, 2 * _PROBE_N, generator=generator) * scale


def _reproduces(module: nn.Module, spec: GatedActivation, h_SG: torch.Tensor) -> bool:
    for dtype in (torch.float32, torch.bfloat16):
        h = h_SG.to(dtype)
        want = cast(Callable[[torch.Tensor], object], module._apply_gate)(h)
        got = apply_activation(h, spec)
        if not (isinstance(want, torch.Tensor) and want.shape == got.shape
                and want.dtype == got.dtype and torch.equal(want, got)):
            return False
    return True


def match_gate(module: nn.Module, gate_fn: str | None) -> GatedActivation | None:
    """The GatedActivation equal to ``module._apply_gate``, or None when none is.

    Args:
        module: a gated transformers experts module with a custom ``_apply_gate``.
        gate_fn: memfine name of its ``act_fn`` (``silu``/``gelu``), or None.

    Returns:
        A spec reproducing ``_apply_gate`` exactly on fp32 and bf16 probes, else None (also
        when the gate raises on the probe, e.g. because it reads a tensor on another device);
        None warns once per class (UserWarning) that the plain path runs the gate.
    """
    limit = _attr_float(module, *LIMIT_ATTRIBUTES)
    scale = 2.0 * limit if limit is not None and limit > 0 else 3.0
    why = "no GatedActivation reproduces it"
    with unset_fake_temporarily(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        h_SG = _probe(scale)
        for spec in _candidates(module, gate_fn):
            try:
                if _reproduces(module, spec, h_SG):
                    return spec
            except Exception as err:  # noqa: BLE001 - a gate we cannot probe stays plain
                why = f"probing it raised {type(err).__name__}: {err}"
                break
    _warn_unmatched(type(module), why)
    return None


def _warn_unmatched(cls: type, why: str) -> None:
    if cls in _WARNED:
        return
    _WARNED.add(cls)
    warnings.warn(f"memfine: {cls.__name__}._apply_gate runs on the plain path ({why}): exact, "
                  "but it saves the gathered rows and the activation's inputs for backward. "
                  "To fuse it, express it as a GatedActivation in "
                  "memfine/hf/gates.py (docs/extending.md)", stacklevel=3)
