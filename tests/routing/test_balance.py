"""Aux-loss-free balancing: the bias update rule and counting once per optimizer step."""

from __future__ import annotations

import pytest
import torch

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.nn import MoETransformerLM
from memfine.routing import update_selection_bias


def test_update_rule_by_hand() -> None:
    bias = torch.zeros(4)
    update_selection_bias(bias, torch.tensor([10, 2, 4, 4]), 1e-3)  # mean load 5
    assert bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3])
    update_selection_bias(bias, torch.tensor([5, 5, 5, 5]), 1e-3)  # at the mean: no move
    assert bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3])
    update_selection_bias(bias, torch.tensor([0, 0, 9, 3]), 0.5)  # mean 3
    assert bias.tolist() == pytest.approx([0.499, 0.501, -0.499, 0.001])
    assert bias.dtype == torch.float32
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \(E,\)=\(4,\)"):
        update_selection_bias(bias, torch.zeros(3), 1e-3)


def _model(recompute: str, num_chunks: int = 1) -> MoETransformerLM:
    moe = MoEConfig(hidden_size=32, intermediate_size=32, num_experts=4, top_k=2,
                    bias_update_rate=1e-2)
    config = ModelConfig(num_layers=2, num_heads=2, max_seq_len=16, moe=moe,
                         chunk=ChunkConfig(num_chunks=num_chunks, recompute=recompute))
    torch.manual_seed(0)
    return MoETransformerLM(config)


def test_counted_once_under_recompute() -> None:
    ids = torch.randint(0, 256, (4, 16))
    biases, counts = [], []
    for recompute, c in (("none", 1), ("experts", 2), ("full", 2)):
        model = _model(recompute, c)
        out = model(ids, ids)
        out.loss.backward()  # recompute runs here; the counts were taken in forward
        counts.append(out.tokens_per_expert)
        model.update_expert_bias(out.tokens_per_expert)
        biases.append(torch.stack([b.moe.router.selection_bias.clone() for b in model.blocks]))
    for c, b in zip(counts[1:], biases[1:], strict=True):
        assert torch.equal(c, counts[0]) and torch.equal(b, biases[0])
    assert int(counts[0].sum()) == 2 * 4 * 16 * 2  # L · T · k: each token once per layer
    expected = torch.sign(counts[0].double().mean(-1, keepdim=True) - counts[0]) * 1e-2
    assert torch.allclose(biases[0].double(), expected)


def test_global_counts_of_two_ranks_equal_one_process() -> None:
    ids = torch.randint(0, 256, (4, 16))
    whole, ranks = _model("none"), _model("none")
    with torch.no_grad():
        counts = whole(ids).tokens_per_expert
        summed = ranks(ids[:2]).tokens_per_expert + ranks(ids[2:]).tokens_per_expert
    assert torch.equal(summed, counts)  # the all-reduce SUM of the ranks' counts
    whole.update_expert_bias(counts)
    ranks.update_expert_bias(summed)
    for a, b in zip(whole.blocks, ranks.blocks, strict=True):
        assert torch.equal(a.moe.router.selection_bias, b.moe.router.selection_bias)
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \(L, E\)=\(2, 4\)"):
        whole.update_expert_bias(counts[0])
