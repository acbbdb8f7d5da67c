"""The suites of ``memfine bench`` and their runner.

Suites: ``experts``, ``chunking``, ``model``, ``hf``, ``counts``.

Each suite module exposes ``NAME``, ``METHODS`` (its method names, in table order) and
``run(opts, device, names) -> list[Point]``; :mod:`memfine.baselines` builds the peer layers they
measure against, :mod:`memfine.bench` measures; :func:`memfine.suites.runner.run_suites` is what
``memfine bench`` and the scripts in ``benchmarks/`` call.
"""

from __future__ import annotations

from types import ModuleType

from memfine.bench.options import COMPILED_SUFFIX
from memfine.suites import chunking, counts, experts, hf, model

SUITE_MODULES: dict[str, ModuleType] = {"experts": experts, "chunking": chunking,
                                        "model": model, "hf": hf, "counts": counts}


def compiled_methods(suite: str) -> tuple[str, ...]:
    """``<method>_compiled`` for each method of ``suite`` that has a compiled variant."""
    return tuple(m + COMPILED_SUFFIX for m in getattr(SUITE_MODULES[suite], "COMPILABLE", ()))


ALL_METHODS = tuple(dict.fromkeys(m for suite, mod in SUITE_MODULES.items()
                                  for m in (*mod.METHODS, *compiled_methods(suite))))


def select_methods(suite: str, requested: tuple[str, ...], compile: bool = False
                   ) -> tuple[str, ...]:
    """The methods of ``suite`` to run, in the suite's order.

    Args:
        suite: a suite name.
        requested: method names (``--methods``); empty selects all of the suite's methods.
        compile: also select ``<method>_compiled`` for each selected method that has a compiled
            variant (``--compile``). A compiled name in ``requested`` is selected without it.

    Raises:
        ValueError: on a requested name that no suite has.
    """
    unknown = sorted(set(requested) - set(ALL_METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; known {list(ALL_METHODS)}")
    base: tuple[str, ...] = SUITE_MODULES[suite].METHODS
    chosen = {n for n in base if n in requested or not requested}
    compiled = [n for n in compiled_methods(suite)
                if n in requested or (compile and n.removesuffix(COMPILED_SUFFIX) in chosen)]
    return tuple(n for n in (*base, *compiled_methods(suite)) if n in chosen or n in compiled)



__all__ = ["ALL_METHODS", "SUITE_MODULES", "compiled_methods", "select_methods"]
