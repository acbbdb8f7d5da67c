"""Named training presets for ``memfine train --preset``.

``small`` is the default (what ``make train`` runs): 400 steps of 4096 bytes, sized to finish in
about 3 minutes on one idle CPU core and in under 10 on a CPU shared with other jobs, with a
validation loss far below the byte-unigram entropy of the pydoc topics. ``tiny`` is a smoke
test: a few seconds for tens of steps.
"""

from __future__ import annotations

from memfine.config import ModelConfig, MoEConfig, TrainConfig

DEFAULT_PRESET = "small"


def _tiny() -> TrainConfig:
    model = ModelConfig(num_layers=2, num_heads=2, max_seq_len=64,
                        moe=MoEConfig(hidden_size=64, intermediate_size=64, num_experts=4,
                                      top_k=2))
    return TrainConfig(model=model, seq_len=64, batch_size=8, max_steps=200, lr=3e-3,
                       warmup_steps=10, eval_every=50, eval_batches=2, log_every=1,
                       sample_tokens=100)


def _small() -> TrainConfig:
    model = ModelConfig(num_layers=4, num_heads=4, max_seq_len=128,
                        moe=MoEConfig(hidden_size=128, intermediate_size=128, num_experts=8,
                                      top_k=2))
    return TrainConfig(model=model, seq_len=128, batch_size=32, max_steps=400, lr=2e-3,
                       warmup_steps=40, eval_every=80, eval_batches=8, log_every=10,
                       sample_tokens=300)


PRESETS = {"tiny": _tiny, "small": _small}


def preset(name: str) -> TrainConfig:
    """Return the :class:`TrainConfig` of preset ``name``.

    Raises:
        ValueError: on an unknown name (the message lists the presets).
    """
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]()
