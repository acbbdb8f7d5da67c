"""torchtitan integration: memfine's buffer-free experts and MemFine chunking in torchtitan MoEs.

Usage, on a built model (before ``parallelize``, as torchtitan applies its converters)::

    from memfine.integrations.torchtitan import convert_model
    convert_model(model)                          # fused experts, no chunks
    convert_model(model, memory_budget="256MiB")  # c per call from MemFine Eq. 8-9 (MACT)

or on the model config, with torchtitan's converter mechanism::

    from memfine.integrations.torchtitan import converter
    spec = model_registry("debugmodel_moe", converters=[converter(num_chunks=4)])

Each MoE block's routed-experts part (``RoutedExperts``: token dispatcher + ``GroupedExperts``)
becomes :class:`~memfine.integrations.torchtitan_modules.MemfineRoutedExperts`. The router, the
shared experts, the routed scaling (``route_norm``, ``route_scale``), the load-balancing buffers
and every parameter (names, shapes, layouts) stay torchtitan's. See docs/torchtitan.md.

Nothing happens on import: torchtitan (extra ``memfine[torchtitan]``) is imported by the
functions here, and nothing in torchtitan is patched.

Reference: MoEBlaze §3-§5; MemFine §4, Eq. 8-9; docs/torchtitan.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from memfine._checks import check_choice
from memfine._optional import require
from memfine.integrations.transformers import HFExpertsConfig, make_config

TESTED_TORCHTITAN_VERSION = (0, 3, 0)
Dispatch = Literal["auto", "memfine", "torchtitan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchtitanExpertsConfig(HFExpertsConfig):
    """Options of memfine's experts inside torchtitan (the transformers options plus dispatch).

    Attributes:
        impl: ``auto`` (fused where exact: ``GroupedExperts``; plain for GPT-OSS's experts),
            ``fused`` (raise where not possible) or ``plain``.
        gemm_backend: grouped GEMM backend (``auto``: ``torch._grouped_mm`` where its alignment
            rules hold, a per-expert loop elsewhere; ``triton`` is not used with torchtitan's
            separate w1/w3).
        index_builder: routing-index builder (``auto``, ``sort_free``, ``argsort``).
        chunk: :class:`memfine.config.ChunkConfig`: fixed ``num_chunks`` c or a
            ``memory_budget_bytes`` per routed-experts block (MACT), and the recompute mode.
        dispatch: ``auto`` (memfine's buffer-free dispatch without expert parallelism,
            torchtitan's dispatcher under it), ``memfine`` or ``torchtitan``.
    """

    dispatch: Dispatch = "auto"

    def __post_init__(self) -> None:
        """Validate every field.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        HFExpertsConfig.__post_init__(self)
        check_choice(self, "dispatch", Dispatch)


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def require_torchtitan() -> Any:
    """Import torchtitan's MoE module and check the version memfine was tested with.

    Returns:
        ``torchtitan.models.common.moe``.

    Raises:
        ImportError: when torchtitan is missing, or its version is not 0.3.x (the MoE module
            layout memfine reads: ``RoutedExperts`` with ``inner_experts`` and
            ``token_dispatcher``).
    """
    tested = ".".join(map(str, TESTED_TORCHTITAN_VERSION))
    try:
        torchtitan = require("torchtitan")
        version = _installed_version()
        moe = require("torchtitan.models.common.moe")
    except ImportError as err:
        raise ImportError(f"memfine's torchtitan integration needs torchtitan=={tested}: "
                          f"pip install 'memfine[torchtitan]' ({err})") from err
    del torchtitan
    if _parse_version(version)[:2] != TESTED_TORCHTITAN_VERSION[:2]:
        raise ImportError(f"memfine's torchtitan integration is tested with torchtitan {tested} "
                          f"(found {version}): pip install 'memfine[torchtitan]'")
    return moe


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "0"


def torchtitan_modules() -> Any:
    """:mod:`memfine.integrations.torchtitan_modules`, imported after the version check.

    Raises:
        ImportError: if torchtitan is missing or not 0.3.x.
    """
    require_torchtitan()
    from memfine.integrations import torchtitan_modules

    return torchtitan_modules


def make_options(config: TorchtitanExpertsConfig | None = None, *,
                 num_chunks: int | None = None, memory_budget: int | str | None = None,
                 **overrides: Any) -> TorchtitanExpertsConfig:
    """Build a :class:`TorchtitanExpertsConfig` from a base config and keyword shortcuts.

    Args:
        config: base options (default: fused where possible, no chunks, dispatch ``auto``).
        num_chunks: fixed chunk count c per routed-experts block (per-chunk recompute).
        memory_budget: activation budget of one block: an int number of bytes or a string with
            a unit (``"256MiB"``; not ``"256"``), as
            :func:`memfine.integrations.transformers.make_config` takes it; c per call from
            MemFine Eq. 8-9 (MACT).
        **overrides: other :class:`TorchtitanExpertsConfig` fields.

    Raises:
        ValueError: on an invalid field value or size (naming ``memory_budget``).
    """
    base = config if config is not None else TorchtitanExpertsConfig()
    cfg = make_config(base, num_chunks=num_chunks, memory_budget=memory_budget, **overrides)
    assert isinstance(cfg, TorchtitanExpertsConfig), "make_config keeps the config's class"
    return cfg


def convert_model(model: nn.Module, config: TorchtitanExpertsConfig | None = None, *,
                  num_chunks: int | None = None, memory_budget: int | str | None = None,
                  **overrides: Any) -> list[str]:
    """Run every MoE block's routed experts of a built torchtitan model with memfine.

    Each ``RoutedExperts`` module becomes a ``MemfineRoutedExperts`` in place: its children
    (``inner_experts`` with the parameters, ``token_dispatcher``), buffers and hooks are kept,
    so ``state_dict()`` keys and values, torchtitan's state-dict adapters to HF and FSDP wrapping
    are those of the unconverted model. Call it before ``parallelize``/``fully_shard``.

    Args:
        model: a torchtitan model (or any module containing ``RoutedExperts``).
        config: options, as in :func:`make_options`.
        num_chunks: fixed chunk count c.
        memory_budget: per-block budget, bytes or ``"256MiB"`` (MACT).
        **overrides: other :class:`TorchtitanExpertsConfig` fields.

    Returns:
        The qualified names of the converted modules.

    Raises:
        ImportError: if torchtitan is missing or not 0.3.x.
        ValueError: on invalid options, an unsupported experts class, or a model without
            ``RoutedExperts``.
    """
    modules = torchtitan_modules()
    cfg = make_options(config, num_chunks=num_chunks, memory_budget=memory_budget, **overrides)
    moe = require_torchtitan()
    names = [name for name, m in model.named_modules() if type(m) is moe.RoutedExperts]
    if not names:
        done = [name for name, m in model.named_modules()
                if isinstance(m, modules.MemfineRoutedExperts)]
        raise ValueError(f"{type(model).__name__} has no torchtitan RoutedExperts module to "
                         f"convert" + (f" (already converted: {done})" if done else ""))
    for name in names:
        modules.MemfineRoutedExperts.convert(model.get_submodule(name), cfg)
    return names


def converter(config: TorchtitanExpertsConfig | None = None, *, num_chunks: int | None = None,
              memory_budget: int | str | None = None, **overrides: Any) -> Any:
    """A torchtitan converter config (``model_registry(..., converters=[converter()])``).

    Arguments as in :func:`convert_model`.

    Returns:
        ``MemfineExpertsConverter.Config``; its ``build().convert(model_config)`` swaps every
        ``RoutedExperts.Config`` for ``MemfineRoutedExperts.Config``.

    Raises:
        ImportError: if torchtitan is missing or not 0.3.x.
        ValueError: on invalid options.
    """
    modules = torchtitan_modules()
    cfg = make_options(config, num_chunks=num_chunks, memory_budget=memory_budget, **overrides)
    return modules.MemfineExpertsConverter.Config(experts=cfg)
