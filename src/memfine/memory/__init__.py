"""Predicted memory: the per-layer model, the pipeline-stage model, the Eq. 8-9 planner, presets.

- :mod:`memfine.memory.layer`: bytes of one MoE layer's forward + backward (saved and peak),
  replayed from the code's allocation timeline (``_timeline_experts``, ``_timeline_layer``).
- :mod:`memfine.memory.layout`: :class:`PlanConfig`, one parallel layout (t, p, e, dp, cp, v, b, s).
- :mod:`memfine.memory.stage`: static + activation memory of each pipeline stage, s′_max and MACT's
  c per skew (MemFine Eq. 1-3, 8, 9) as frozen ``StagePlan`` / ``SkewPlan`` / ``Plan``.
- :mod:`memfine.memory.planner`: s′_max (MemFine Eq. 8) and the one binned chunk count (Eq. 9).
- :mod:`memfine.memory.presets`: published model shapes for ``memfine plan``.

Measured bytes live in :mod:`memfine.measure`; the runtime chunk loop in :mod:`memfine.schedule`.
"""
