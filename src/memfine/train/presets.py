"""Named training presets for ``memfine train --preset``.

``small`` is the default (what ``make train`` runs): 400 steps of 4096 bytes, sized to finish in
about 3 minutes on one idle CPU core and in under 10 on a CPU shared with other jobs, with a
validation loss far below the byte-unigram entropy of the pydoc topics. ``tiny`` is a smoke
test: a few seconds for tens of steps.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from memfine._checks import lookup
from memfine.config import ModelConfig, MoEConfig, TrainConfig

DEFAULT_PRESET = "small"


def _preset(*, num_layers: int, num_heads: int, width: int, num_experts: int, seq_len: int,
            **train: Any) -> TrainConfig:
    """Square experts (n = d), top-2 routing, context = ``seq_len``; ``train``: the rest."""
    moe = MoEConfig(hidden_size=width, intermediate_size=width, num_experts=num_experts, top_k=2)
    model = ModelConfig(num_layers=num_layers, num_heads=num_heads, max_seq_len=seq_len, moe=moe)
    return TrainConfig(model=model, seq_len=seq_len, **train)


PRESETS: MappingProxyType[str, TrainConfig] = MappingProxyType({
    "tiny": _preset(num_layers=2, num_heads=2, width=64, num_experts=4, seq_len=64,
                    batch_size=8, max_steps=200, lr=3e-3, warmup_steps=10, eval_every=50,
                    eval_batches=2, log_every=1, sample_tokens=100),
    "small": _preset(num_layers=4, num_heads=4, width=128, num_experts=8, seq_len=128,
                     batch_size=32, max_steps=400, lr=2e-3, warmup_steps=40, eval_every=80,
                     eval_batches=8, log_every=10, sample_tokens=300),
})


def preset(name: str) -> TrainConfig:
    """Return the :class:`TrainConfig` of preset ``name`` (frozen; derive others with ``replace``).

    Raises:
        ValueError: on an unknown name (the message lists the presets).
    """
    return lookup(PRESETS, name, "preset")
