r"""torchtitan config functions with memfine's experts, and a command-line override.

torchtitan 0.3 selects a run by ``--module M --config F``: ``M`` is a Python module (a short name
such as ``qwen3``, or a full import path) and ``F`` a function in it returning a
``Trainer.Config``. This module is such a ``M``: each function below calls torchtitan's own config
function of the same name and applies memfine's converter
(:class:`~memfine.integrations.torchtitan_modules.MemfineExpertsConverter`) to its model, so::

    python -m torchtitan.train --module memfine.integrations.torchtitan_configs \\
        --config qwen3_moe_debug

trains torchtitan's Qwen3-MoE debug model with memfine's experts (no chunks). The model spec is
not reachable from torchtitan's command line, so chunk and budget options travel through
torchtitan's override mechanism (``--override.imports``, a JSON object of keyword arguments, as
:func:`memfine.integrations.torchtitan.make_options` takes them)::

    --override.imports \
        'memfine.integrations.torchtitan_modules.memfine_experts={"num_chunks": 2}'
    --override.imports \
        'memfine.integrations.torchtitan_modules.memfine_experts={"memory_budget": "256MiB"}'

The override also turns memfine on in any of torchtitan's own configs
(``--module qwen3 --config qwen3_30b_a3b --override.imports ...memfine_experts``); it lives in
:mod:`memfine.integrations.torchtitan_modules`, the module that imports torchtitan.

Everything else (data, optimizer, parallelism, checkpoints, paths) is torchtitan's config as
published, and is overridden on the command line as usual (``--training.seq_len 2048``).
torchtitan (extra ``memfine[torchtitan]``) is imported when a function is called.
Reference: docs/torchtitan.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from memfine.integrations.torchtitan import make_options, torchtitan_modules

__all__ = [
    "deepseek_v3_16b", "deepseek_v3_671b", "deepseek_v3_debugmodel", "gpt_oss_120b",
    "gpt_oss_20b", "gpt_oss_debugmodel", "qwen3_30b_a3b", "qwen3_moe_debug", "with_memfine",
]


def with_memfine(config: Any, **options: Any) -> Any:
    """Apply memfine's converter to a torchtitan ``Trainer.Config``'s model, in place.

    Args:
        config: a torchtitan ``Trainer.Config`` whose ``model_spec`` holds an MoE model.
        **options: as :func:`memfine.integrations.torchtitan.make_options` (``num_chunks``,
            ``memory_budget``, ``impl``, ...).

    Returns:
        ``config``, its ``model_spec.model`` converted (every ``RoutedExperts.Config`` becomes
        ``MemfineRoutedExperts.Config``).

    Raises:
        ImportError: if torchtitan is missing or not 0.3.x.
        ValueError: on invalid options, a config without a model spec or without MoE blocks,
            or quantised experts (the message names the converter to drop).
    """
    modules = torchtitan_modules()
    if getattr(config, "model_spec", None) is None:
        raise ValueError("Trainer.Config.model_spec must be set to apply memfine's experts")
    converter = modules.MemfineExpertsConverter(modules.MemfineExpertsConverter.Config(
        experts=make_options(**options)))
    config.model_spec.model = converter.convert(config.model_spec.model)
    return config


def _torchtitan_config(model: str, name: str) -> Any:
    """Call torchtitan's config function ``name`` of ``torchtitan.models.<model>``; convert."""
    torchtitan_modules()  # checks the torchtitan version first
    registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    return with_memfine(getattr(registry, name)())


def _config_function(model: str, name: str, what: str) -> Callable[[], Any]:
    """A config function ``name`` (no arguments, as ``--config`` calls it) of this module."""

    def config_function() -> Any:
        return _torchtitan_config(model, name)

    config_function.__name__ = config_function.__qualname__ = name
    config_function.__doc__ = f"Torchtitan's ``{name}`` ({what}) with memfine's experts."
    return config_function


qwen3_moe_debug = _config_function("qwen3", "qwen3_moe_debug", "Qwen3-MoE debugmodel_moe")
qwen3_30b_a3b = _config_function("qwen3", "qwen3_30b_a3b", "Qwen3-30B-A3B")
deepseek_v3_debugmodel = _config_function("deepseek_v3", "deepseek_v3_debugmodel",
                                          "DeepSeek-V3 debugmodel")
deepseek_v3_16b = _config_function("deepseek_v3", "deepseek_v3_16b", "DeepSeek-V3 16B")
deepseek_v3_671b = _config_function("deepseek_v3", "deepseek_v3_671b", "DeepSeek-V3 671B")
gpt_oss_debugmodel = _config_function("gpt_oss", "gpt_oss_debugmodel", "GPT-OSS debugmodel")
gpt_oss_20b = _config_function("gpt_oss", "gpt_oss_20b", "gpt-oss-20b")
gpt_oss_120b = _config_function("gpt_oss", "gpt_oss_120b", "gpt-oss-120b")
