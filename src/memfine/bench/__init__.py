"""The one benchmark system (``memfine bench`` and the scripts in ``benchmarks/``).

The suites (:mod:`memfine.bench.suites`) measure through the shared harness
(:mod:`memfine.bench.harness`), so every suite writes the same CSV schema
(:mod:`memfine.bench.results`).
"""

from __future__ import annotations

from types import ModuleType

from memfine.bench.options import SUITES, BenchOptions, LayerShape, Point
from memfine.bench.suites import chunking, experts, hf, model

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
