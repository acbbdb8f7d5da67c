"""The measuring core of the one benchmark system (``memfine bench`` and ``benchmarks/``).

:mod:`memfine.bench.harness` times and measures methods, :mod:`memfine.bench.results` writes
the one CSV schema, :mod:`memfine.bench.options` holds the options and shapes,
:mod:`memfine.bench.output` the tables and plots, :mod:`memfine.bench.verdicts` the line saying
what wins. The suites that use it are :mod:`memfine.suites`; the peer layers they measure
against are :mod:`memfine.baselines`.
"""

from __future__ import annotations

from memfine.bench.options import COMPILED_SUFFIX, SUITES, BenchOptions, LayerShape, Point

__all__ = ["COMPILED_SUFFIX", "SUITES", "BenchOptions", "LayerShape", "Point"]
