"""Presets and the training-specific TrainConfig rules (memfine.train.presets)."""

from __future__ import annotations

import pytest

from memfine.config import TrainConfig
from memfine.train import DEFAULT_PRESET, PRESETS, preset


def test_presets_are_valid_and_round_trip() -> None:
    assert DEFAULT_PRESET == "small" and sorted(PRESETS) == ["small", "tiny"]
    for name in PRESETS:
        config = preset(name)
        assert TrainConfig.from_dict(config.to_dict()) == config
        assert config.seq_len == config.model.max_seq_len
        assert config.data == "pydoc" and config.dtype == "float32"


def test_default_preset_size() -> None:
    small = preset("small")
    moe = small.model.moe
    assert (small.model.num_layers, moe.hidden_size, moe.num_experts, moe.top_k) == (4, 128, 8, 2)
    assert (small.max_steps, small.batch_size, small.seq_len) == (400, 32, 128)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"preset must be one of \['small', 'tiny'\], got 'huge'"):
        preset("huge")


def test_float16_training_is_rejected() -> None:
    with pytest.raises(ValueError, match="TrainConfig.dtype must be 'float32', 'bfloat16' or "
                                         "'float64' .*loss scaling.*got 'float16'"):
        TrainConfig(dtype="float16")
