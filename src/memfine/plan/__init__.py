"""Planning a training layout (``memfine plan``): which (t, p, e, dp, cp, b, c) fits a budget.

- :mod:`memfine.plan.layout`: :class:`PlanConfig`, one parallel layout (t, p, e, dp, cp, v, b, s).
- :mod:`memfine.plan.presets`: published model shapes and their run settings.
- :mod:`memfine.plan.stage`: static + activation memory of each pipeline stage, s′_max and MACT's
  c per skew (MemFine Eq. 1-3, 8, 9) as frozen ``StagePlan`` / ``SkewPlan`` / ``Plan``.
- :mod:`memfine.plan.hf_config`: a transformers ``config.json`` → :class:`ModelPreset`.
- :mod:`memfine.plan.search`: every valid layout on N devices, ranked by recompute FLOPs and the
  1F1B bubble.

The per-layer bytes come from :mod:`memfine.memory`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
