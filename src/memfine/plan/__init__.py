"""Planning a training layout (``memfine plan``): which (t, p, e, dp, cp, b, c) fits a budget.

- :mod:`memfine.plan.layout`: :class:`PlanConfig`, one parallel layout (t, p, e, dp, cp, v, b, s).
- :mod:`memfine.plan.presets`: published model shapes and their run settings.
- :mod:`memfine.plan.stage`: each pipeline stage's memory, s′_max and c (MemFine Eq. 1-3, 8, 9).
- :mod:`memfine.plan.hf_config`: a transformers ``config.json`` → :class:`ModelPreset`.
- :mod:`memfine.plan.search`: every valid layout on N devices, ranked (``--search``).

The per-layer bytes come from :mod:`memfine.memory`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
