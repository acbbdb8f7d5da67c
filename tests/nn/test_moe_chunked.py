"""The MoE layer and the language model under token chunking and every recompute mode.

Chunked == unchunked on outputs, aux losses, counters and every gradient (router included);
routing runs once per layer and step, recomputation included; ``ModelConfig.chunk`` (fixed c or a
budget, the agreement hook) is honoured; 50 training steps with c=4 match c=1; the skew knob.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.measure.peak import PeakMemoryTracker
from memfine.memory import layer as layer_memory
from memfine.nn import MoELayer, MoETransformerLM
from memfine.nn.model import Block
from memfine.schedule.policy import ChunkPolicy
from tolerances import LOSS_ATOL, assert_chunked_close

pytestmark = pytest.mark.usefixtures("one_thread")
D, N, E, K = 16, 24, 6, 2
MOE = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)


def _layer_run(chunk: ChunkConfig, T: int = 29) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layer = MoELayer(MOE, chunk=chunk)
    with torch.no_grad():
        layer.router.weight.normal_()  # unit-scale logits: a varied routing
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    out, aux = layer(x)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    (loss + 0.1 * aux.load_balancing_loss + 0.01 * aux.z_loss).backward()
    return {"out": out.detach(), "lbl": aux.load_balancing_loss.detach(),
            "z": aux.z_loss.detach(), "counts": aux.tokens_per_expert,
            "num_chunks": torch.tensor(aux.num_chunks), "grad_x": x.grad,
            "grad_router": layer.router.weight.grad, "grad_w_up": layer.experts.w_up.grad,
            "grad_w_down": layer.experts.w_down.grad}


@pytest.mark.parametrize("c", [
    pytest.param(2, id="c2"), pytest.param(3, id="T_not_divisible_by_c"), pytest.param(8, id="c8"),
    pytest.param(40, id="c_greater_than_T"),
])
@pytest.mark.parametrize("recompute", ["none", "experts", "full"])
def test_layer_chunked_equals_unchunked(c: int, recompute: str) -> None:
    want = _layer_run(ChunkConfig(num_chunks=1, recompute="none"))
    got = _layer_run(ChunkConfig(num_chunks=c, recompute=recompute))  # type: ignore[arg-type]
    assert int(got.pop("num_chunks")) == c
    want.pop("num_chunks")
    for name in ("lbl", "z", "counts"):  # routing, losses and counters: exactly equal
        assert torch.equal(got[name], want[name]), name
    for name in ("out", "grad_x", "grad_router", "grad_w_up", "grad_w_down"):
        assert_chunked_close(got[name], want[name], name)


class _CountingRouter:
    """Counts the routing decisions of a router (:meth:`TopKRouter.decide`: both the plain
    forward and the router node call it once per forward; backward's recompute reuses the
    decision)."""

    def __init__(self, router: torch.nn.Module) -> None:
        self.calls = 0
        self.decide = router.decide
        router.decide = self  # type: ignore[method-assign]  # an instance attribute

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        return self.decide(*args, **kwargs)


def _tiny_config(chunk: ChunkConfig, num_layers: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=32, num_layers=num_layers, num_heads=2, max_seq_len=16,
                       moe=MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4,
                                     top_k=2),
                       chunk=chunk)


@pytest.mark.parametrize("recompute", ["none", "experts", "full"])
def test_router_runs_once_per_layer_and_step(recompute: str) -> None:
    model = MoETransformerLM(_tiny_config(ChunkConfig(num_chunks=3, recompute=recompute)))
    counters = []
    for block in model.blocks:
        counters.append(_CountingRouter(block.moe.router))
    ids = torch.randint(0, 32, (2, 12))
    for step in range(1, 3):
        out = model(ids, ids)
        (out.loss + 0.01 * out.load_balancing_loss).backward()
        assert [c.calls for c in counters] == [step, step]


def _block_run(recompute: str, c: int) -> tuple[dict[str, torch.Tensor], int]:
    """Block forward + backward: outputs, grads and the bytes alive after forward (no output)."""
    torch.manual_seed(0)
    block = Block(_tiny_config(ChunkConfig(num_chunks=c, recompute=recompute),  # type: ignore[arg-type]
                               num_layers=1))
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with PeakMemoryTracker() as tracker:
        out, aux = block(x)
        kept = tracker.mark("forward") - out.untyped_storage().nbytes()
        out.backward(torch.ones_like(out))
    grads = {"out": out.detach(), "grad_x": x.grad}
    grads.update({name: p.grad for name, p in block.named_parameters()})
    return grads, kept


def test_block_recompute_modes_match_and_keep_less() -> None:
    """``full`` keeps less than ``experts``, which keeps less than ``none``; same numbers."""
    runs = {mode: _block_run(mode, 2) for mode in ("none", "experts", "full")}
    want = runs["none"][0]
    for mode in ("experts", "full"):
        for name, value in runs[mode][0].items():
            assert_chunked_close(value, want[name], f"{mode} {name}")
    assert runs["full"][1] < runs["experts"][1] < runs["none"][1]


def _losses(chunk: ChunkConfig, steps: int = 25) -> list[float]:
    torch.manual_seed(0)
    model = MoETransformerLM(_tiny_config(chunk))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Learnable sequences (arithmetic progressions mod V), so the loss falls and routing settles.
    g = torch.Generator().manual_seed(3)
    start = torch.randint(0, 32, (steps, 2, 1), generator=g)
    stride = torch.randint(1, 4, (steps, 2, 1), generator=g)
    data = (start + stride * torch.arange(9)) % 32
    losses = []
    for step in range(steps):
        out = model(data[step, :, :-1], data[step, :, 1:])
        assert out.loss is not None
        opt.zero_grad()
        (out.loss + 0.01 * out.load_balancing_loss).backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


def test_training_losses_chunked_equal_unchunked() -> None:
    """25 AdamW steps of the small LM: c=4 with chunked recompute gives the c=1 losses."""
    want = _losses(ChunkConfig(num_chunks=1, recompute="none"))
    got = _losses(ChunkConfig(num_chunks=4, recompute="experts"))
    assert want[-1] < want[0]  # it trains
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOSS_ATOL


def test_model_budget_chooses_c_per_layer_and_reports_it() -> None:
    """A budget in ModelConfig.chunk: every layer asks the shared policy (once per step, not in
    recompute), reports c in MoEAux and last_decision, and the run equals the unchunked one."""
    base = _tiny_config(ChunkConfig(num_chunks=1, recompute="none"))
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1), base.moe)
    T = 2 * 12
    budget = probe.layer_peak(T, 4, 2)  # c = 2's exact peak; c = 1 peaks higher
    assert probe.layer_peak(T, 4, 1) > budget
    config = dataclasses.replace(base, chunk=ChunkConfig(memory_budget_bytes=budget))
    model = MoETransformerLM(config)
    assert all(b.moe.policy is model.chunk_policy for b in model.blocks)
    ids = torch.randint(0, 32, (2, 12))
    out = model(ids, ids)
    assert out.loss is not None
    out.loss.backward()
    assert [a.num_chunks for a in out.aux] == [2, 2]
    assert [a.recompute for a in out.aux] == ["experts", "experts"]
    for block in model.blocks:
        decision = block.moe.last_decision
        assert decision is not None and decision.num_chunks == 2
        assert decision.budget_bytes == budget and decision.predicted_peak_bytes <= budget
        assert decision.rows == T * base.moe.top_k
    torch.manual_seed(0)
    ref = MoETransformerLM(base)
    ref.load_state_dict(model.state_dict())
    ref_out = ref(ids, ids)
    assert ref_out.loss is not None
    assert_chunked_close(out.loss.detach(), ref_out.loss.detach(), "loss")


def test_layer_takes_chunk_or_policy() -> None:
    policy = ChunkPolicy(ChunkConfig(num_chunks=2), MOE)
    assert MoELayer(MOE, policy=policy).policy is policy
    assert MoELayer(MOE).policy.config == ChunkConfig(num_chunks=1, recompute="none")
    with pytest.raises(ValueError, match="chunk or policy, not both"):
        MoELayer(MOE, chunk=ChunkConfig(), policy=policy)
    other = ChunkPolicy(ChunkConfig(), dataclasses.replace(MOE, top_k=1, renormalize=False))
    with pytest.raises(ValueError, match="policy.moe must equal config"):
        MoELayer(MOE, policy=other)


def test_skew_knob_routes_every_token_to_the_hot_experts() -> None:
    """Experiment knob: a selection bias > 1 on experts 0..k-1 is MemFine's worst case."""
    skewed = dataclasses.replace(MOE, skew_hot_experts=K, skew_bias=2.0)
    layer = MoELayer(skewed)
    assert layer.router.selection_bias.tolist() == [2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    x = torch.randn(50, D)
    _, aux = layer(x)
    assert aux.tokens_per_expert.tolist() == [50, 50, 0, 0, 0, 0]
    # the weights stay the unbiased scores: same output as routing to {0, 1} by hand
    plain = MoELayer(MOE)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if k != "router.selection_bias"}, strict=False)
    scores = torch.softmax(x @ layer.router.weight.t(), -1)[:, :K]
    want = plain.experts(x, torch.tensor([0, 1]).expand(50, K), scores / scores.sum(-1, True))
    assert_chunked_close(layer(x)[0].detach(), want.detach(), "out")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"skew_hot_experts": 7}, r"MoEConfig.skew_hot_experts must be in \[0, 6\], got 7"),
    ({"skew_hot_experts": -1}, r"MoEConfig.skew_hot_experts must be in \[0, 6\], got -1"),
    ({"skew_bias": -0.5, "skew_hot_experts": 1}, r"MoEConfig.skew_bias must be in \[0.0, inf\)"),
    ({"skew_bias": 1.0}, r"MoEConfig.skew_hot_experts must be >= 1 when skew_bias > 0, got 0"),
])
def test_skew_knob_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MOE, **kwargs)


def test_a_fixed_count_replays_no_memory_model_until_its_record_is_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = layer_memory.layer_peak_bytes

    def spy(moe: MoEConfig, num_tokens: int, *args: object, **kwargs: object) -> int:
        calls.append(num_tokens)
        return real(moe, num_tokens, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_memory, "layer_peak_bytes", spy)
    layer = MoELayer(MOE, chunk=ChunkConfig(num_chunks=2))
    for tokens in (8, 16, 24):  # each new T used to replay the layer's timeline
        layer(torch.randn(tokens, D))[0].sum().backward()
    assert calls == []
    decision = layer.last_decision
    assert decision is not None and calls == [24]
    assert (decision.num_chunks, decision.rows, decision.budget_bytes) == (2, 24 * K, None)
    assert decision.predicted_peak_bytes == real(MOE, 24, 4, num_chunks=2, recompute="experts")
    assert layer.last_decision == decision and calls == [24]  # made once, then kept
