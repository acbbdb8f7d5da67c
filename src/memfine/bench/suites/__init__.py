"""The suites of ``memfine bench``: ``experts``, ``chunking``, ``model`` and ``hf``.

Each suite module exposes ``NAME``, ``METHODS`` (its method names, in table order) and
``run(opts, device, names) -> list[Point]``; :mod:`memfine.bench.suites.layers` builds the layers
they measure.
"""
