"""Which parallel layout fits: model sizes from a transformers config.json, the layout search.

- :mod:`memfine.layout.hf_config`: a ``config.json`` → :class:`memfine.memory.presets.ModelPreset`.
- :mod:`memfine.layout.search`: every valid (t, p, e, dp, cp, b, recompute, bins) on N devices,
  planned with :mod:`memfine.memory.stage`, ranked by recompute FLOPs and the 1F1B bubble.
"""
