"""Gradient accumulation with the balancing loss on: the routing pre-pass gives the step's f.

Four micro-batches of 2 sequences, with the step's selection counts from the no-grad pre-pass,
must give the losses and gradients of one batch of 8 (the balancing loss included); without the
pre-pass the balancing loss of the micro-batches differs (each has its own f).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from memfine.config import ModelConfig, MoEConfig, TrainConfig
from memfine.nn import MoETransformerLM
from memfine.train.accumulation import needs_step_counts, step_selection_counts
from tolerances import DISTRIBUTED_LOSS_ATOL, assert_close

N, B, Q = 4, 2, 8
COEF = 0.5  # a large balancing-loss weight, so a wrong f shows in every gradient


def _model(**moe_fields: float) -> MoETransformerLM:
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2,
                    aux_loss_coef=COEF, **moe_fields)
    torch.manual_seed(0)
    return MoETransformerLM(ModelConfig(num_layers=2, num_heads=2, max_seq_len=Q, moe=moe))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, 256, (N * B, Q), generator=g),
            torch.randint(0, 256, (N * B, Q), generator=g))


def _step(model: MoETransformerLM, x: torch.Tensor, y: torch.Tensor, num_micro: int,
          step_counts: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Losses (CE, LBL, z) averaged over the micro-batches, and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    losses = []
    for x_BQ, y_BQ in zip(x.chunk(num_micro), y.chunk(num_micro), strict=True):
        out = model(x_BQ, y_BQ, step_selection_counts=step_counts)
        loss = out.loss + COEF * out.load_balancing_loss + model.config.moe.z_loss_coef * out.z_loss
        (loss / num_micro).backward()
        losses.append(torch.stack([out.loss, out.load_balancing_loss, out.z_loss]).detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.stack(losses).mean(0), grads


def _prepass(model: MoETransformerLM, x: torch.Tensor) -> torch.Tensor:
    return step_selection_counts(model, x.chunk(N), contextlib.nullcontext, torch.device("cpu"))


def test_accumulated_step_equals_the_larger_batch() -> None:
    model = _model()
    x, y = _batch()
    want_losses, want = _step(model, x, y, 1, None)
    counts = _prepass(model, x)
    assert counts.shape == (2, 4 + 1) and counts.dtype == torch.int64
    # per layer: k·(N·B·Q) selections in all, from N shares (one process, N micro-batches)
    assert counts[:, :-1].sum(1).tolist() == [2 * N * B * Q] * 2
    assert counts[:, -1].tolist() == [N, N]
    got_losses, got = _step(model, x, y, N, counts)
    torch.testing.assert_close(got_losses, want_losses, atol=DISTRIBUTED_LOSS_ATOL, rtol=0)
    for name, grad in got.items():
        assert_close(grad, want[name], grad=True, msg=name)
    # the control: each micro-batch's own f gives another balancing loss and router gradient
    own_losses, own = _step(model, x, y, N, None)
    assert abs(float(own_losses[1] - want_losses[1])) > 10 * DISTRIBUTED_LOSS_ATOL
    router = "blocks.0.moe.router.weight"
    assert float((own[router] - want[router]).abs().max()) > 1e-4


def test_prepass_routes_as_the_real_pass_with_jitter() -> None:
    """Router jitter draws from the RNG: the pre-pass restores it, so the real micro-batches
    draw the same noise and select exactly the counted experts."""
    model = _model(router_jitter_eps=0.5)
    x, y = _batch()
    before = torch.get_rng_state()
    counts = _prepass(model, x)
    assert torch.equal(torch.get_rng_state(), before)
    model.zero_grad(set_to_none=True)
    selected = torch.zeros_like(counts[:, :-1])
    for x_BQ, y_BQ in zip(x.chunk(N), y.chunk(N), strict=True):
        selected += model(x_BQ, y_BQ, step_selection_counts=counts).tokens_per_expert
    assert torch.equal(selected, counts[:, :-1])


def test_bad_step_counts_shape_is_an_error() -> None:
    model = _model()
    x, _ = _batch()
    with pytest.raises(ValueError, match=r"step_selection_counts must be \(L, E \+ 1\) with L=2"):
        model(x, step_selection_counts=torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"step_selection_counts must be \(E \+ 1,\)=\(5,\)"):
        model(x, step_selection_counts=torch.zeros(2, 4, dtype=torch.int64))


@pytest.mark.parametrize(("grad_accum", "coef", "want"), [
    pytest.param(4, 0.01, True, id="accum_with_balancing_loss"),
    pytest.param(4, 0.0, False, id="balancing_loss_off"),
    pytest.param(1, 0.01, False, id="one_micro_batch"),
])
def test_prepass_runs_only_when_f_matters(grad_accum: int, coef: float, want: bool) -> None:
    base = TrainConfig()
    moe = dataclasses.replace(base.model.moe, aux_loss_coef=coef)
    config = dataclasses.replace(base, grad_accum=grad_accum,
                                 model=dataclasses.replace(base.model, moe=moe))
    assert needs_step_counts(config) is want
