"""Predicted memory of one MoE layer, and the Eq. 8-9 chunk-count arithmetic.

- :mod:`memfine.memory.layer`: bytes of one MoE layer's forward + backward (saved and peak),
  replayed from the code's allocation timeline (:mod:`memfine.timeline`).
- :mod:`memfine.memory.planner`: s′_max (MemFine Eq. 8) and the one binned chunk count (Eq. 9).
- :mod:`memfine.memory.step_timeline`: one training step of the language model (embedding,
  attention, norms, every MoE layer's timeline, logits, loss), and :mod:`memfine.memory.step`:
  the per-layer plan (recompute mode, c) that meets a whole-step budget at least recompute.
- :mod:`memfine.memory.bounds`: a lower bound of a model's bytes (experts' weights, layer
  inputs) from integer arithmetic, checked by the commands before anything is built.

Whole training layouts (pipeline stages, presets, the layout search) are planned in
:mod:`memfine.plan`; measured bytes live in :mod:`memfine.measure`; the runtime chunk loop in
:mod:`memfine.schedule`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
