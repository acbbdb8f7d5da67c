"""AdamW groups and the warm-up + cosine LR schedule (memfine.train.optim)."""

from __future__ import annotations

import pytest
import torch

from memfine.config import TrainConfig
from memfine.train.optim import build_optimizer, lr_factor


@pytest.mark.parametrize(("step", "expected"), [
    pytest.param(0, 0.25, id="warmup_first"),
    pytest.param(3, 1.0, id="warmup_last"),
    pytest.param(4, 1.0, id="cosine_start"),
    pytest.param(9, 0.1 + 0.9 * 0.5, id="cosine_middle"),
    pytest.param(14, 0.1, id="cosine_end"),
    pytest.param(100, 0.1, id="after_decay"),
])
def test_lr_factor(step: int, expected: float) -> None:
    got = lr_factor(step, warmup_steps=4, decay_steps=14, min_ratio=0.1)
    assert got == pytest.approx(expected, abs=1e-12)


def test_weight_decay_on_matrices_only_and_schedule_follows_lr_factor() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    config = TrainConfig(lr=0.01, weight_decay=0.1, warmup_steps=2, max_steps=6,
                         min_lr_ratio=0.1)
    optimizer, scheduler = build_optimizer(model, config)
    decay, no_decay = optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([3, 4])]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == 3  # Linear bias, LayerNorm weight and bias
    for step in range(8):
        want = 0.01 * lr_factor(step, warmup_steps=2, decay_steps=6, min_ratio=0.1)
        assert scheduler.get_last_lr()[0] == pytest.approx(want, rel=1e-12)
        optimizer.step()
        scheduler.step()
