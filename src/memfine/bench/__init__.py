"""The suites of ``memfine bench``: ``experts``, ``chunking``, ``model`` and ``hf``.

Each suite module exposes ``NAME``, ``METHODS`` (its method names, in table order) and
``run(opts, device, names) -> list[Point]``; the measurements go through the shared harness
(:mod:`memfine.bench.harness`), so every suite writes the same CSV schema.
"""

from __future__ import annotations

from types import ModuleType

from memfine.bench import suite_chunking as chunking
from memfine.bench import suite_experts as experts
from memfine.bench import suite_hf as hf
from memfine.bench import suite_model as model
from memfine.bench.options import SUITES, BenchOptions, LayerShape, Point

SUITE_MODULES: dict[str, ModuleType] = {"experts": experts, "chunking": chunking,
                                        "model": model, "hf": hf}
ALL_METHODS = tuple(dict.fromkeys(m for mod in SUITE_MODULES.values() for m in mod.METHODS))


def select_methods(suite: str, requested: tuple[str, ...]) -> tuple[str, ...]:
    """The methods of ``suite`` to run: all of them, or those of ``requested`` it has.

    Raises:
        ValueError: on a requested name that no suite has.
    """
    unknown = sorted(set(requested) - set(ALL_METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; known {list(ALL_METHODS)}")
    names: tuple[str, ...] = SUITE_MODULES[suite].METHODS
    return tuple(n for n in names if n in requested) if requested else names


__all__ = ["ALL_METHODS", "SUITES", "SUITE_MODULES", "BenchOptions", "LayerShape", "Point",
           "select_methods"]
