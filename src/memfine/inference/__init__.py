"""What is done with a trained checkpoint: generate, evaluate, export.

Modules: ``trained`` (``memfine generate``, ``memfine eval``, ``memfine export`` on a run's
checkpoint; reading an export back), ``adapters`` (a LoRA run's adapters alone, or merged into
its base). Checkpoints themselves, and loading their weights into a model, are
:mod:`memfine.artifacts`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
