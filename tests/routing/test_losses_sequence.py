"""DeepSeek-V3's sequence-wise balance loss against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from memfine.config import MoEConfig
from memfine.nn import MoELayer
from memfine.routing import route, sequence_balance_loss
from tolerances import assert_close


def test_hand_computed_value() -> None:
    # One sequence, Q = 2, E = 2, k = 1: s' rows [0.75, 0.25] and [0.5, 0.5], both tokens on
    # expert 0 → f = E/(k·Q)·[2, 0] = [2, 0], P = [0.625, 0.375], loss = 2·0.625 = 1.25.
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    index = torch.tensor([[0], [0]])
    assert_close(sequence_balance_loss(scores, index, seq_len=2), torch.tensor(1.25))
    # sigmoid-style scores are normalised over E first: [0.6, 0.2] → [0.75, 0.25]
    assert_close(sequence_balance_loss(torch.tensor([[0.6, 0.2], [0.3, 0.3]]), index, 2),
                 torch.tensor(1.25))


def test_uniform_is_one_and_batch_has_no_extra_factor() -> None:
    Q, E, k = 8, 4, 2
    scores = torch.full((Q, E), 1 / E)
    index = (torch.arange(Q * k) % E).view(Q, k)
    assert_close(sequence_balance_loss(scores, index, Q), torch.tensor(1.0))
    logits = torch.randn(Q, E)
    one = route(logits, k)
    two = route(torch.cat([logits, logits]), k)
    single = sequence_balance_loss(one.scores, one.top_k_index, Q)
    double = sequence_balance_loss(two.scores, two.top_k_index, Q)
    assert_close(double, single)  # two identical sequences: the value of one
    whole = sequence_balance_loss(two.scores, two.top_k_index, 2 * Q)  # one long sequence
    assert_close(whole, single)


def test_mean_over_sequences_and_padding() -> None:
    Q, E, k = 4, 4, 2
    logits = torch.randn(3 * Q, E)
    r = route(logits, k)
    parts = [sequence_balance_loss(r.scores[i * Q:(i + 1) * Q], r.top_k_index[i * Q:(i + 1) * Q],
                                   Q) for i in range(3)]
    assert_close(sequence_balance_loss(r.scores, r.top_k_index, Q), torch.stack(parts).mean())
    mask = torch.ones(3 * Q, dtype=torch.bool)
    mask[Q - 1] = False  # last token of sequence 0 is padding
    mask[2 * Q:] = False  # sequence 2 is all padding: left out of the mean
    first = sequence_balance_loss(r.scores[:Q - 1], r.top_k_index[:Q - 1], Q - 1)
    expected = (first + parts[1]) / 2
    assert_close(sequence_balance_loss(r.scores, r.top_k_index, Q, mask), expected)
    with pytest.raises(ValueError, match="whole sequences of seq_len=5"):
        sequence_balance_loss(r.scores, r.top_k_index, 5)


def test_moe_layer_returns_it_per_sequence() -> None:
    config = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                       seq_aux_loss_coef=1e-3)
    layer = MoELayer(config)
    x = torch.randn(3, 5, 8)
    _, aux = layer(x)
    r = layer.router(x.view(-1, 8))
    assert aux.sequence_balance_loss is not None
    assert_close(aux.sequence_balance_loss, sequence_balance_loss(r.scores, r.top_k_index, 5))
    aux.sequence_balance_loss.backward()
    assert layer.router.weight.grad is not None and bool(layer.router.weight.grad.ne(0).any())
    _, off = MoELayer(MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2))(x)
    assert off.sequence_balance_loss is None  # coefficient 0: not computed
