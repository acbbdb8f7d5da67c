"""MoETransformerLM: causality, loss, tied embeddings, generation, input validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfine.config import ModelConfig, MoEConfig
from memfine.nn import MoETransformerLM
from tolerances import assert_close

V, Q = 32, 12


def _model(max_seq_len: int = Q) -> MoETransformerLM:
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    model = MoETransformerLM(ModelConfig(vocab_size=V, num_layers=2, num_heads=2,
                                         max_seq_len=max_seq_len, moe=moe))
    with torch.no_grad():  # break the near-uniform init so routing and logits vary per token
        model.embed.weight.normal_()
    return model


def test_causal() -> None:
    model = _model()
    ids = torch.randint(0, V, (2, Q))
    changed = ids.clone()
    p = 7
    changed[0, p] = (ids[0, p] + 1) % V
    logits, logits_changed = model(ids).logits, model(changed).logits
    assert_close(logits_changed[:, :p], logits[:, :p])  # earlier positions: unchanged
    assert_close(logits_changed[1], logits[1])  # the other sequence: unchanged
    assert not torch.allclose(logits_changed[0, p:], logits[0, p:])  # later ones do change


def test_loss_is_the_cross_entropy_of_the_logits() -> None:
    model = _model()
    ids = torch.randint(0, V, (2, Q))
    targets = torch.randint(0, V, (2, Q))
    out = model(ids, targets)
    assert out.logits.shape == (2, Q, V) and out.logits.dtype == torch.float32
    assert out.loss is not None and torch.isfinite(out.loss)
    assert torch.equal(out.loss, F.cross_entropy(out.logits.view(-1, V), targets.view(-1)))
    assert model(ids).loss is None
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name


def test_aux_losses_average_the_layers() -> None:
    model = _model()
    out = model(torch.randint(0, V, (2, Q)))
    assert len(out.aux) == model.config.num_layers
    assert_close(out.load_balancing_loss,
                 sum(a.load_balancing_loss for a in out.aux) / len(out.aux))
    assert_close(out.z_loss, sum(a.z_loss for a in out.aux) / len(out.aux))
    for a in out.aux:
        assert int(a.tokens_per_expert.sum()) == 2 * Q * 2  # k · T


def test_tied_embeddings() -> None:
    model = _model()
    ids = torch.randint(0, V // 2, (2, Q))  # tokens V/2.. never appear in the input
    out = model(ids)
    h = model.embed(ids)
    for block in model.blocks:
        h, _ = block(h)
    assert torch.equal(out.logits, F.linear(model.norm(h), model.embed.weight).float())
    assert [n for n, p in model.named_parameters() if p.shape == (V, 16)] == ["embed.weight"]
    out.logits.logsumexp(-1).sum().backward()
    unseen_grad = model.embed.weight.grad[V // 2:]
    assert bool((unseen_grad.abs().sum(-1) > 0).all())  # reached only through the output side


def test_generate() -> None:
    model = _model(max_seq_len=4)
    prompt = torch.randint(0, V, (2, 3))
    new = 3  # 3 + 3 > max_seq_len: the window slides
    ids = model.generate(prompt, new, generator=torch.Generator().manual_seed(1))
    assert ids.shape == (2, 3 + new) and ids.dtype == torch.int64
    assert torch.equal(ids[:, :3], prompt)
    assert int(ids.min()) >= 0 and int(ids.max()) < V
    again = model.generate(prompt, new, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ids, again)
    assert torch.equal(model.generate(prompt, 0), prompt)
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -0.5$"):
        model.generate(prompt, 1, temperature=-0.5)


def test_generate_at_temperature_zero_is_greedy() -> None:
    model = _model(max_seq_len=4).eval()
    prompt = torch.randint(0, V, (2, 3))
    ids = model.generate(prompt, 5, temperature=0.0)
    expected = prompt
    for _ in range(5):  # the most likely next token, one at a time (the window slides)
        nxt = model(expected[:, -4:]).logits[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, nxt], dim=1)
    assert torch.equal(ids, expected)
    assert torch.equal(model.generate(prompt, 5, temperature=0.0,
                                       generator=torch.Generator().manual_seed(7)), ids)


@pytest.mark.parametrize(("shape", "message"), [
    pytest.param((Q,), r"^input_ids must be \(B, Q\), got \(12,\)$", id="1d"),
    pytest.param((2, 3, 4), r"^input_ids must be \(B, Q\), got \(2, 3, 4\)$", id="3d"),
    pytest.param((1, Q + 1), r"^sequence length 13 exceeds max_seq_len=12$", id="too_long"),
])
def test_bad_input_shapes(shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model()(torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("bad_id", [V, -1])
def test_out_of_range_ids_raise_value_error(bad_id: int) -> None:
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size="):
        _model()(torch.tensor([[1, bad_id]]))


@pytest.mark.parametrize("shape", [(1, 0), (0, 4)], ids=["Q0", "B0"])
def test_empty_input_raises_value_error(shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="input_ids must hold at least one token"):
        _model()(torch.zeros(shape, dtype=torch.long))
