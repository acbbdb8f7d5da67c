"""Validation loss: one value per validation set, however it is cut into batches."""

from __future__ import annotations

import pytest
import torch

from memfine.config import ModelConfig, MoEConfig
from memfine.data import val_batches
from memfine.nn import MoETransformerLM
from memfine.reports.evaluation import evaluate
from tolerances import assert_close


@pytest.mark.parametrize("batch_size", [1, 3, 5, 16])
def test_validation_loss_is_the_mean_over_every_token(batch_size: int) -> None:
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    model = MoETransformerLM(ModelConfig(num_layers=1, num_heads=2, max_seq_len=8, moe=moe))
    ids = torch.randint(0, 256, (400,))
    batches = val_batches(ids, num_batches=2, batch_size=batch_size, seq_len=8)
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    logits = model.eval()(x).logits  # every window at once: the mean over all its tokens
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).double(),
                                             y.reshape(-1)).float()
    got = evaluate(model, batches, torch.device("cpu"))
    assert_close(torch.tensor(got), want)
    assert model.training  # left in train mode
