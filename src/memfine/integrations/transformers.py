"""transformers experts backend: ``experts_implementation="memfine"`` for HF MoE models.

Usage::

    from memfine.integrations.transformers import register
    register()                                   # once per process; options below
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="memfine")
    # or: model.set_experts_implementation("memfine")

``register(num_chunks=4)`` or ``register(memory_budget="256MiB")`` turns on token chunking with
per-chunk recompute (MemFine); :func:`configure` sets the same options on one model (stored in its
config as ``memfine_experts``, saved with it, taking precedence over ``register``'s);
:func:`from_pretrained` loads any checkpoint with per-model options
(``from_pretrained(AutoModelForCausalLM, path, memfine_experts={"chunk": {"num_chunks": 4}})``);
``register(name="memfine_4_chunks", num_chunks=4)`` binds options to a name that transformers'
own ``from_pretrained(path, experts_implementation="memfine_4_chunks")`` accepts for any
checkpoint (nothing is written into the config). ``last_decision(experts_module)`` returns the
:class:`memfine.schedule.ChunkDecision` (c, recompute mode, s″, predicted bytes) of a chunked
experts module's last call.

Nothing happens on import: transformers is imported by :func:`register` only (extra
``memfine[hf]``), and nothing in transformers is patched; the function is added to
``transformers.integrations.moe.ExpertsInterface`` under its name.

Legend: T tokens, K top-k slots, E experts, D = d, N = n, C chunks.
Reference: docs/design.md §7 (the experts interface); MoEBlaze §4-§5; MemFine §4 (chunks).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from memfine._checks import check_choice, fail
from memfine._optional import require
from memfine.config import ChunkConfig, ConfigBase
from memfine.hf.experts import compute_dtype, run_module
from memfine.hf.experts import last_decision as last_decision  # public: c of a call
from memfine.hf.layout import ExpertsPlan, expert_weights, plan_experts
from memfine.hf.peft import parametrized_lora, pending_lora

MIN_TRANSFORMERS_VERSION = (5, 7, 0)
IMPLEMENTATION_NAME = "memfine"
CONFIG_ATTRIBUTE = "memfine_experts"

Impl = Literal["auto", "fused", "plain"]
GemmBackend = Literal["auto", "grouped_mm", "loop", "triton"]
IndexBuilder = Literal["auto", "sort_free", "argsort"]
ExpertsFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_log = logging.getLogger(__name__)
_LOGGED_ATTRIBUTE = "_memfine_plan_logged"  # set on an experts module once its plan is logged


@dataclass(frozen=True, kw_only=True, slots=True)
class HFExpertsConfig(ConfigBase):
    """Options of the ``memfine`` experts implementation.

    Attributes:
        impl: ``auto`` (fused where the module's layout allows it, else plain), ``fused``
            (raise where it does not) or ``plain``.
        gemm_backend: grouped GEMM backend; ``auto`` uses ``torch._grouped_mm`` where its
            alignment rules hold and a per-expert loop elsewhere.
        index_builder: routing-index builder (``auto``, ``sort_free``, ``argsort``).
        chunk: token chunking (:class:`memfine.config.ChunkConfig`): a fixed ``num_chunks`` or a
            ``memory_budget_bytes`` per experts block, and the recompute mode (``experts`` and
            ``full`` checkpoint each chunk; ``none`` only splits).
    """

    impl: Impl = "auto"
    gemm_backend: GemmBackend = "auto"
    index_builder: IndexBuilder = "auto"
    chunk: ChunkConfig = field(default_factory=ChunkConfig)

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        check_choice(self, "impl", Impl)
        check_choice(self, "gemm_backend", GemmBackend)
        check_choice(self, "index_builder", IndexBuilder)
        if not isinstance(self.chunk, ChunkConfig):
            fail(self, "chunk", "a ChunkConfig", self.chunk)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HFExpertsConfig:
        """Build from :meth:`to_dict` output (``chunk`` as a nested dict).

        Raises:
            ValueError: on unknown keys, here or in ``chunk``.
        """
        if isinstance(data, dict) and isinstance(data.get("chunk"), dict):
            data = {**data, "chunk": ChunkConfig.from_dict(data["chunk"])}
        return super(HFExpertsConfig, cls).from_dict(data)


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def require_transformers() -> Any:
    """Import transformers and check it has the experts interface memfine plugs into.

    Returns:
        The ``transformers.integrations.moe`` module.

    Raises:
        ImportError: when transformers is missing or older than 5.7.0 (the first version whose
            ``from_pretrained``/``set_experts_implementation`` accept registered names).
    """
    minimum = ".".join(map(str, MIN_TRANSFORMERS_VERSION))
    try:
        transformers = require("transformers")
    except ImportError as err:
        raise ImportError(f"memfine's experts backend needs transformers>={minimum}: "
                          f"pip install 'memfine[hf]'") from err
    version = getattr(transformers, "__version__", "0")
    if _parse_version(version) < MIN_TRANSFORMERS_VERSION:
        raise ImportError(f"memfine's experts backend needs transformers>={minimum} "
                          f"(ExpertsInterface accepting registered names), found {version}: "
                          f"pip install -U 'memfine[hf]'")
    moe = require("transformers.integrations.moe")
    if not hasattr(moe, "ExpertsInterface"):
        raise ImportError(f"transformers {version} has no integrations.moe.ExpertsInterface; "
                          f"memfine needs transformers>={minimum}")
    return moe


def make_config(config: HFExpertsConfig | None = None, *, num_chunks: int | None = None,
                memory_budget: int | str | None = None, **overrides: Any) -> HFExpertsConfig:
    """Build an :class:`HFExpertsConfig` from a base config and keyword shortcuts.

    Args:
        config: base options (default :class:`HFExpertsConfig`).
        num_chunks: fixed chunk count c (sets ``chunk.num_chunks``).
        memory_budget: an int number of bytes, or a string with a unit as the command line's
            ``--memory-budget`` takes it (``"256MiB"``, ``"16GiB"``, ``"80GB"``); a string
            without a unit is refused (:func:`memfine.units.checked_byte_size`). Sets
            ``chunk.memory_budget_bytes``; c is then chosen per call from the received rows,
            MemFine Eq. 8-9.
        **overrides: other :class:`HFExpertsConfig` fields (``impl``, ``gemm_backend``, ...).

    Raises:
        ValueError: on an invalid field value; naming ``memory_budget``, the value and the
            allowed forms on a size that is not one.
    """
    cfg = config if config is not None else HFExpertsConfig()
    chunk = cfg.chunk
    if num_chunks is not None:
        chunk = dataclasses.replace(chunk, num_chunks=num_chunks)
    if memory_budget is not None:
        from memfine.units import checked_byte_size

        chunk = dataclasses.replace(chunk, memory_budget_bytes=checked_byte_size(
            memory_budget, "memory_budget"))
    return dataclasses.replace(cfg, chunk=chunk, **overrides)


def _module_config(module: nn.Module, default: HFExpertsConfig) -> HFExpertsConfig:
    data = getattr(getattr(module, "config", None), CONFIG_ATTRIBUTE, None)
    if data is None:
        return default
    if isinstance(data, HFExpertsConfig):
        return data
    return HFExpertsConfig.from_dict(dict(data))


def resolve_plan(module: nn.Module, impl: Impl) -> ExpertsPlan:
    """The path memfine takes for ``module`` under ``impl``.

    Raises:
        ValueError: when ``impl="fused"`` and the module needs the plain path (says why).
    """
    plan = plan_experts(module)
    if impl == "plain":
        return ExpertsPlan(path="plain", activation=None, reason="impl='plain'")
    if impl == "fused" and plan.path != "fused":
        raise ValueError(f"HFExpertsConfig.impl='fused' is not possible for "
                         f"{type(module).__name__}: {plan.reason}; use impl='auto' or 'plain'")
    return plan


def memfine_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                            config: HFExpertsConfig | None = None) -> torch.Tensor:
    """The experts-interface function: ``(module, hidden_states, top_k_index, top_k_weights)``.

    Args:
        module: a transformers experts module (``@use_experts_implementation``).
        hidden_states: (T, d) activations, cast to the weights' dtype (as transformers'
            ``grouped_mm`` does) or, inside ``torch.autocast``, to the autocast dtype (the
            weights are then cast per call as ``nn.Linear``'s are, so x and H are saved in bf16
            under bf16 autocast; :func:`memfine.experts.autocast_operands`).
        top_k_index: (T, k) int64 expert ids; ids outside [0, num_experts) are sentinels
            (expert parallelism) and contribute exactly zero.
        top_k_weights: (T, k) routing weights.
        config: options; the module's ``config.memfine_experts`` (see :func:`configure`) wins.

    PEFT LoRA on the expert weights (``target_parameters``, plain ``peft.get_peft_model``) is
    found on the module at call time and run as split LoRA on the fused path, never as
    W + s·B·A (:func:`memfine.hf.peft.parametrized_lora`).

    Returns:
        (T, d) tensor in ``hidden_states``' dtype.

    Raises:
        ValueError: on shapes that do not fit the module, or an impossible ``impl``.

    Memory: fused path, unchunked: x (T·d) + H (S·G) + weights and int32 indices saved
    (:class:`memfine.experts.FusedExpertsFunction`); chunked with recompute: x and the routing
    tensors only, each chunk's H is recomputed in backward (peak: one chunk). Under autocast
    these are in the autocast dtype, plus the per-call casts of the weights.
    """
    cfg = _module_config(module, config if config is not None else HFExpertsConfig())
    plan = resolve_plan(module, cfg.impl)
    originals: frozenset[str] = frozenset()
    lora = pending_lora(module)
    if lora is None:  # PEFT's own parametrization (plain peft.get_peft_model)
        lora, originals = parametrized_lora(module, plan.path == "fused", plan.reason)
    weights = expert_weights(module, originals)
    D = weights.w_up_EDG.shape[1]
    if hidden_states.dim() != 2 or hidden_states.shape[1] != D:
        raise ValueError(f"hidden_states must be (T, d) with d={D}, got "
                         f"{tuple(hidden_states.shape)}")
    T = hidden_states.shape[0]
    shape_TK = tuple(top_k_index.shape)
    if top_k_index.dim() != 2 or shape_TK[0] != T or tuple(top_k_weights.shape) != shape_TK:
        raise ValueError(f"top_k_index and top_k_weights must be (T, k) with T={T}, got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if not getattr(module, _LOGGED_ATTRIBUTE, False):
        _log.info("memfine experts for %s: %s path%s", type(module).__name__, plan.path,
                  f" ({plan.reason})" if plan.reason else f", activation {plan.activation}")
        setattr(module, _LOGGED_ATTRIBUTE, True)
    x_TD = hidden_states.to(compute_dtype(hidden_states, weights.w_up_EDG.dtype))
    out_TD = run_module(module, plan, weights, x_TD, top_k_index, top_k_weights,
                        chunk=cfg.chunk, backend=cfg.gemm_backend,
                        index_builder=cfg.index_builder, lora=lora)
    return out_TD.to(hidden_states.dtype)


def _bind(config: HFExpertsConfig) -> ExpertsFn:
    def memfine_experts(module: nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return memfine_experts_forward(module, hidden_states, top_k_index, top_k_weights,
                                       config=config)

    def runs_fused(module: nn.Module) -> bool:
        try:
            return resolve_plan(module, _module_config(module, config).impl).path == "fused"
        except ValueError:
            return False

    memfine_experts.__doc__ = memfine_experts_forward.__doc__
    memfine_experts.memfine_config = config  # type: ignore[attr-defined]
    # read by hf/peft.py (which sits below this module) through the interface's function
    memfine_experts.memfine_runs_fused = runs_fused  # type: ignore[attr-defined]
    return memfine_experts


def register(config: HFExpertsConfig | None = None, *, num_chunks: int | None = None,
             memory_budget: int | str | None = None, name: str = IMPLEMENTATION_NAME,
             **overrides: Any) -> ExpertsFn:
    """Register memfine in transformers' ``ExpertsInterface`` under ``name``.

    Calling it again replaces the registration (e.g. with other chunk options).

    Args:
        config: options (default :class:`HFExpertsConfig`: fused where possible, no chunks).
        num_chunks: fixed chunk count c per experts block (recompute per chunk).
        memory_budget: per-block activation budget: an int number of bytes or a string with a
            unit (``"256MiB"``, ``"16GiB"``; not ``"16"``), as in :func:`make_config`; c from
            MemFine Eq. 8-9.
        name: the ``experts_implementation`` name.
        **overrides: other :class:`HFExpertsConfig` fields (``impl``, ``gemm_backend``, ...).

    Returns:
        The registered function ``(module, hidden_states, top_k_index, top_k_weights) -> out``.

    Raises:
        ImportError: if transformers is missing or older than 5.7.0.
        ValueError: on invalid options.

    Side effects: adds ``name`` to ``transformers.integrations.moe.ExpertsInterface``
    (process-wide, as transformers' own registrations are).
    """
    moe = require_transformers()
    fn = _bind(make_config(config, num_chunks=num_chunks, memory_budget=memory_budget,
                           **overrides))
    moe.ExpertsInterface.register(name, fn)
    return fn


def _is_experts_module(module: nn.Module) -> bool:
    has_up = hasattr(module, "gate_up_proj") or hasattr(module, "up_proj")
    down = getattr(module, "down_proj", None)
    return has_up and hasattr(module, "num_experts") and isinstance(down, torch.Tensor)


def configure(model: nn.Module, config: HFExpertsConfig | None = None, *,
              num_chunks: int | None = None, memory_budget: int | str | None = None,
              **overrides: Any) -> HFExpertsConfig:
    """Set memfine options on one model (every experts module's config gets ``memfine_experts``).

    The options are stored as a plain dict on the (sub-)configs of the model's experts modules,
    so ``save_pretrained`` keeps them and ``from_pretrained(..., memfine_experts={...})`` sets
    them. They take precedence over :func:`register`'s. Selecting the implementation is still
    ``model.set_experts_implementation("memfine")``.

    Args:
        model: a transformers model (or any module containing experts modules).
        config: base options, as in :func:`register`.
        num_chunks: fixed chunk count c, as in :func:`register`.
        memory_budget: per-block activation budget, bytes or ``"256MiB"``, as in
            :func:`register`.
        **overrides: other :class:`HFExpertsConfig` fields, as in :func:`register`.

    Returns:
        The resolved :class:`HFExpertsConfig`.

    Raises:
        ValueError: on invalid options, or when the model has no experts module.
    """
    cfg = make_config(config, num_chunks=num_chunks, memory_budget=memory_budget, **overrides)
    configs = {id(m.config): m.config for m in model.modules()
               if _is_experts_module(m) and getattr(m, "config", None) is not None}
    if not configs:
        raise ValueError(f"{type(model).__name__} has no transformers experts module "
                         f"(gate_up_proj/up_proj + down_proj with num_experts)")
    for model_config in configs.values():
        setattr(model_config, CONFIG_ATTRIBUTE, cfg.to_dict())
    return cfg


def from_pretrained(model_class: Any, path: str | os.PathLike[str], *,
                    memfine_experts: HFExpertsConfig | dict[str, Any] | None = None,
                    **kwargs: Any) -> nn.Module:
    """Load any checkpoint with ``experts_implementation="memfine"`` and per-model options.

    transformers hands a ``from_pretrained`` keyword that the checkpoint's config does not
    define to the model's constructor (a ``TypeError`` for ``memfine_experts=`` on an ordinary
    checkpoint); this loader takes the option itself, loads, and calls :func:`configure`.

    Args:
        model_class: a transformers model or auto class (``AutoModelForCausalLM``, ...).
        path: checkpoint directory or hub id, as for ``model_class.from_pretrained``.
        memfine_experts: options for this model: an :class:`HFExpertsConfig` or its dict form
            (``{"chunk": {"num_chunks": 4}}``); None keeps the checkpoint's own
            ``memfine_experts`` (if any) and :func:`register`'s.
        **kwargs: passed to ``model_class.from_pretrained``; ``experts_implementation``
            defaults to ``"memfine"``.

    Returns:
        The loaded model.

    Raises:
        ImportError: if transformers is missing or older than 5.7.0.
        ValueError: on invalid options, or options for a model without experts modules.

    Side effects: registers memfine's experts function (default options) when no function is
    registered under the requested name yet.
    """
    moe = require_transformers()
    name = kwargs.setdefault("experts_implementation", IMPLEMENTATION_NAME)
    if name == IMPLEMENTATION_NAME and name not in moe.ExpertsInterface():
        register()
    config = memfine_experts
    if isinstance(config, dict):
        config = HFExpertsConfig.from_dict(config)
    model: nn.Module = model_class.from_pretrained(path, **kwargs)
    if config is not None:
        configure(model, config)
    return model
