"""Reading a transformers experts module: its weights in memfine's layout and the path it can take.

transformers (v5) experts modules hold ``gate_up_proj`` (E, G, d) and ``down_proj`` (E, d, n)
(``is_transposed=False``), or ``gate_up_proj`` (E, d, G) and ``down_proj`` (E, n, d)
(``is_transposed=True``); non-gated experts (``has_gate=False``) hold ``up_proj`` instead of
``gate_up_proj``; ``has_bias`` adds ``*_bias`` (E, G) and (E, d); ``act_fn`` is the activation and
``_apply_gate`` splits H into gate and up (``[gate | up]`` by default; models with an interleaved
layout, ``is_concatenated=False``, override it). Nothing here imports transformers: the module is
read through its attributes only.

Legend: E experts (local to this rank under expert parallelism), D = d, N = n, G = 2n (gated)
or n (non-gated).
Reference: docs/design.md §7-§8 (the transformers experts interface).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, SupportsInt, cast

import torch
from torch import nn
from torch.nn import functional as F

from memfine.activations import GATE_FUNCTIONS, gated_name
from memfine.config import GatedActivation
from memfine.hf.gates import GATE_ATTRIBUTES, match_gate
from memfine.ops.up_projection import UpWeights, up_shape

ExpertsPath = Literal["fused", "plain"]
_PLAN_ATTRIBUTE = "_memfine_plan"  # (key, ExpertsPlan) kept on an experts module


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """A module's expert weights as memfine reads them: views, never copies of parameters.

    Attributes:
        w_up_EDG: (E, d, G) up-projection (gate and up halves as the module stores them); a
            transposed view of ``gate_up_proj``/``up_proj`` when the module is not transposed.
        w_down_END: (E, n, d) down-projection (a transposed view of ``down_proj`` likewise).
        b_up_EG: (E, G) up-projection bias, or None.
        b_down_ED: (E, d) down-projection bias, or None.
        w_up_second_EDN: None, or the (E, d, n) up half of a gated up-projection held as its
            own tensor (torchtitan's ``w3``); ``w_up_EDG`` is then the (E, d, n) gate half.
    """

    w_up_EDG: torch.Tensor
    w_down_END: torch.Tensor
    b_up_EG: torch.Tensor | None
    b_down_ED: torch.Tensor | None
    w_up_second_EDN: torch.Tensor | None = None

    @property
    def w_up(self) -> UpWeights:
        """The up-projection as :func:`memfine.experts.run_experts` takes it (tensor or pair)."""
        if self.w_up_second_EDN is None:
            return self.w_up_EDG
        return (self.w_up_EDG, self.w_up_second_EDN)

    @property
    def shape_EDGN(self) -> tuple[int, int, int, int]:
        """(E, d, G, n): experts, hidden size, up-projection width, intermediate size."""
        E, D, G = up_shape(self.w_up)
        return E, D, G, self.w_down_END.shape[1]


@dataclass(frozen=True, slots=True)
class ExpertsPlan:
    """How memfine runs one experts module.

    Attributes:
        path: ``fused`` (:class:`memfine.experts.FusedExpertsFunction`: saves x and H; biases are
            passed to it) or ``plain`` (grouped matmuls with autograd over the routed rows,
            adding biases per row and calling the module's own gate / activation / post-expert
            norm).
        activation: memfine activation for the fused path (a name of
            ``memfine.activations.ACTIVATIONS``, or a
            :class:`memfine.config.GatedActivation` reproducing a custom ``_apply_gate``),
            None on the plain path (the module's own functions are used).
        reason: why the plain path was taken ("" on the fused path).
    """

    path: ExpertsPath
    activation: str | GatedActivation | None
    reason: str = ""


def _local(weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Plain tensor of a (possibly DTensor) expert weight, keeping autograd.

    A DTensor whose local shard already has the module's expert count and the full trailing
    shape (replicated, or sharded along the expert dimension under expert parallelism) becomes
    its local shard (``to_local()``, no communication); any other sharding is gathered with
    ``full_tensor()`` (correct, at the price of an all-gather and a full-size copy).
    """
    if not torch.distributed.is_available():
        return weight
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return weight
    local = weight.to_local()
    if local.shape[0] == num_experts and local.shape[1:] == weight.shape[1:]:
        return local
    return weight.full_tensor()


def _param(module: nn.Module, name: str, originals: Collection[str] = ()) -> torch.Tensor:
    if name in originals:  # the unparametrized tensor (torch.nn.utils.parametrize)
        parametrizations = cast(nn.ModuleDict, module.parametrizations)
        return cast(torch.Tensor, parametrizations[name].original)
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no tensor attribute {name!r}: not a "
                         f"transformers experts module (expected gate_up_proj/up_proj, down_proj)")
    return value


def expert_weights(module: nn.Module, originals: Collection[str] = ()) -> ExpertWeights:
    """Return the module's expert weights in memfine's layout (views; DTensors made local).

    Args:
        module: a transformers experts module (``@use_experts_implementation``).
        originals: names of parametrized weights whose original (unparametrized) tensor is
            read, e.g. PEFT's LoRA weights that memfine runs as split adapters.

    Returns:
        :class:`ExpertWeights` with w_up (E, d, G) and w_down (E, n, d).

    Raises:
        ValueError: if a weight is missing or the shapes do not fit each other and
            ``module.num_experts``.
    """
    has_gate = bool(getattr(module, "has_gate", True))
    has_bias = bool(getattr(module, "has_bias", False))
    transposed = bool(getattr(module, "is_transposed", False))
    E = int(cast(SupportsInt, module.num_experts))
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up = _local(_param(module, up_name, originals), E)
    down = _local(_param(module, "down_proj", originals), E)
    if up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{up_name} and down_proj must be 3-D, got {tuple(up.shape)} and "
                         f"{tuple(down.shape)}")
    w_up_EDG = up if transposed else up.transpose(1, 2)
    w_down_END = down if transposed else down.transpose(1, 2)
    (E_up, D, G), (E_down, N, D_down) = w_up_EDG.shape, w_down_END.shape
    expected_G = 2 * N if has_gate else N
    if not (E_up == E_down == E and D_down == D and expected_G == G):
        raise ValueError(
            f"{type(module).__name__}: expected {up_name} and down_proj for E={E} experts with "
            f"G = {'2n' if has_gate else 'n'} (is_transposed={transposed}), got "
            f"{tuple(up.shape)} and {tuple(down.shape)}")
    b_up = b_down = None
    if has_bias:
        b_up = _local(_param(module, f"{up_name}_bias"), E)
        b_down = _local(_param(module, "down_proj_bias"), E)
        if tuple(b_up.shape) != (E, G) or tuple(b_down.shape) != (E, D):
            raise ValueError(f"{up_name}_bias must be (E, G)=({E}, {G}) and down_proj_bias "
                             f"(E, d)=({E}, {D}), got {tuple(b_up.shape)} and "
                             f"{tuple(b_down.shape)}")
    return ExpertWeights(w_up_EDG=w_up_EDG, w_down_END=w_down_END, b_up_EG=b_up, b_down_ED=b_down)


def _elementwise_name(act_fn: object) -> str | None:
    """The memfine name of a transformers activation module, or None when it has none.

    Exact types only (a subclass may change the function): SiLU (``silu``/``swish``, or the
    function ``F.silu``), tanh GELU (``gelu_pytorch_tanh``, ``gelu_python_tanh``) and ReLU
    (``nn.ReLU`` or ``F.relu``). Exact-erf GELU (``gelu``) has no memfine counterpart (memfine's
    ``gelu`` is the tanh approximation).
    """
    if act_fn is F.silu:
        return "silu"
    if act_fn is F.relu:
        return "relu"
    name = type(act_fn).__name__
    if type(act_fn) is nn.SiLU or name == "SiLUActivation":
        return "silu"
    if type(act_fn) is nn.ReLU:
        return "relu"
    if name == "ReLUSquaredActivation":
        return "relu2"
    if type(act_fn) is nn.GELU and act_fn.approximate == "tanh":
        return "gelu"
    if name in ("GELUTanh", "PytorchGELUTanh"):
        inner = getattr(act_fn, "act", None)
        keywords = getattr(inner, "keywords", {})
        is_tanh_c = getattr(inner, "func", None) is F.gelu and keywords.get("approximate") == "tanh"
        is_tanh_python = getattr(inner, "__name__", "") == "_gelu_tanh_python"
        return "gelu" if (is_tanh_c or is_tanh_python) else None
    return None


def _has_default_gate(module: nn.Module) -> bool:
    """True when ``_apply_gate`` is transformers' default ``act_fn(H[:, :n]) * H[:, n:]``."""
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None:
        return True  # versions without _apply_gate always split [gate | up]
    return getattr(gate, "__name__", "") == "_default_apply_gate" and gate.__module__.startswith(
        "transformers.")


def _plan_key(module: nn.Module) -> tuple[object, ...]:
    """What :func:`plan_experts` reads from the module (its cached plan is valid while equal)."""
    names = ("has_bias", "has_gate", "has_post_expert_norm", *GATE_ATTRIBUTES)
    return (type(module), type(getattr(module, "act_fn", None)),
            *(getattr(module, name, None) for name in names))


def _choose_plan(module: nn.Module) -> ExpertsPlan:
    if getattr(module, "has_post_expert_norm", False):
        return ExpertsPlan(path="plain", activation=None, reason="has_post_expert_norm (a norm "
                           "on each expert output Y: the routing-weight gradient would need Y)")
    has_gate = bool(getattr(module, "has_gate", True))
    act = _elementwise_name(getattr(module, "act_fn", None))
    name = type(module).__name__
    if has_gate and not _has_default_gate(module):
        spec = match_gate(module, act if act in GATE_FUNCTIONS else None)
        if spec is None:
            return ExpertsPlan(path="plain", activation=None, reason=f"custom _apply_gate of "
                               f"{name} that no GatedActivation reproduces")
        return ExpertsPlan(path="fused", activation=spec)
    if act is None:
        return ExpertsPlan(path="plain", activation=None, reason=f"activation "
                           f"{type(getattr(module, 'act_fn', None)).__name__} has no memfine "
                           f"counterpart")
    if not has_gate:
        return ExpertsPlan(path="fused", activation=act)
    gated = gated_name(act)  # the ACTIVATIONS entry computing act_fn(gate) * up
    if gated is None:
        return ExpertsPlan(path="plain", activation=None,
                           reason=f"gated {act} has no memfine counterpart")
    return ExpertsPlan(path="fused", activation=gated)


def plan_experts(module: nn.Module) -> ExpertsPlan:
    """Choose memfine's path for this experts module (cached on the module).

    The fused path takes biases (``has_bias``) and any gate memfine computes itself: the
    default ``[gate | up]`` gate whose ``act_fn`` is the gate of a gated entry of
    ``memfine.activations.ACTIVATIONS`` (SiLU, tanh-GELU), a non-gated SiLU / tanh-GELU /
    ReLU / ReLU², or a custom ``_apply_gate`` that a :class:`GatedActivation` reproduces
    exactly (GPT-OSS's clamped interleaved SwiGLU, the clamped SwiGLUs of DeepSeek-V4 and
    others; :func:`memfine.hf.gates.match_gate`). A post-expert norm, exact-erf
    GELU, gated ReLU or ReLU² and gates no spec reproduces take the plain path, which is exact
    for any gate because it calls the module's own functions.

    Returns:
        The :class:`ExpertsPlan`.
    """
    key = _plan_key(module)
    cached = getattr(module, _PLAN_ATTRIBUTE, None)
    if cached is not None and cached[0] == key:
        plan: ExpertsPlan = cached[1]
        return plan
    plan = _choose_plan(module)
    setattr(module, _PLAN_ATTRIBUTE, (key, plan))
    return plan
