"""memfine's experts inside torchtitan-style selective activation checkpointing (SAC): the same
loss and gradients as without SAC, and SAC's cache does not keep the fused experts' GEMMs."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed "
                    "(pip install -c constraints.txt -e '.[torchtitan]')")

import torch  # noqa: E402
from torch.utils.checkpoint import (  # noqa: E402
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torchtitan_models import build_model, forward_tokens, model_config  # noqa: E402

from memfine.integrations import torchtitan_checkpoint  # noqa: E402
from memfine.integrations.torchtitan import convert_model  # noqa: E402
from memfine.measure.profiled import ProfiledPeakMemory  # noqa: E402
from tolerances import assert_close  # noqa: E402

# torchtitan's SelectiveAC keeps every compute-intensive op's output; these are the ones here.
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default,
         torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _with_sac(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.layers.values():
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs,
                              context_fn=lambda: create_selective_checkpoint_contexts(_policy))

        layer.forward = wrapped
    return model


def _run(sac: bool, num_chunks: int, suspend: bool = True):
    model = build_model(model_config("qwen3", dim=64, hidden=128, num_experts=8, top_k=2,
                                     n_layers=2))
    convert_model(model, num_chunks=num_chunks)
    if sac:
        _with_sac(model)
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    modes = torchtitan_checkpoint._SAC_MODES
    if not suspend:
        torchtitan_checkpoint._SAC_MODES = ()
    try:
        with ProfiledPeakMemory() as prof:
            loss = forward_tokens(model, tokens).logsumexp(-1).mean()
            prof.mark("forward")
            loss.backward()
    finally:
        torchtitan_checkpoint._SAC_MODES = modes
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, prof.marks["forward"]


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_sac_keeps_loss_and_gradients_and_not_the_experts_gemms(num_chunks: int) -> None:
    loss, grads, _ = _run(sac=False, num_chunks=num_chunks)
    sac_loss, sac_grads, kept = _run(sac=True, num_chunks=num_chunks)
    _, _, cached = _run(sac=True, num_chunks=num_chunks, suspend=False)
    assert_close(sac_loss, loss)
    for name, grad in grads.items():
        assert_close(sac_grads[name], grad, grad=True, msg=name)
    # bytes alive after forward: SAC's cache held the fused experts' GEMM outputs, at least the
    # up-projection products H (T·k, 2n) fp32 of both layers, which memfine does not keep
    T, k, n, layers = 128, 2, 128, 2
    assert cached - kept >= layers * T * k * 2 * n * 4, (cached, kept)
