"""Predicted memory: the per-layer model, the pipeline-stage model, the Eq. 8-9 planner, presets.

- :mod:`memfine.memory.layer`: bytes of one MoE layer's forward + backward (saved and peak),
  replayed from the code's allocation timeline (``_timeline_experts``, ``_timeline_layer``).
- :mod:`memfine.memory.stage`: activation + static memory of one pipeline stage (MemFine Eq. 1-2).
- :mod:`memfine.memory.planner`: s′_max (MemFine Eq. 8) and the binned chunk count (Eq. 9).
- :mod:`memfine.memory.presets`: published model shapes for ``memfine plan``.

Measured bytes live in :mod:`memfine.measure`; the runtime chunk loop in :mod:`memfine.schedule`.
"""
