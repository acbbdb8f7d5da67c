"""MoETransformerLM.compile_regions: per-region compilation for sharded models (docs/compile.md).

Under torchrun the expert all-to-alls and FSDP2's hooks stay eager and each block's
collective-free regions are compiled; on one process the same regions must give the eager
losses and gradients.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from memfine.config import ModelConfig, MoEConfig
from memfine.nn import MoETransformerLM
from tolerances import assert_close


def _model() -> MoETransformerLM:
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    torch.manual_seed(0)
    return MoETransformerLM(ModelConfig(num_layers=2, num_heads=2, max_seq_len=8, moe=moe))


def _step(model: MoETransformerLM, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(ids, ids)
    (out.loss + 0.01 * out.load_balancing_loss + 0.001 * out.z_loss).backward()
    return [out.loss.detach(), out.load_balancing_loss.detach(),
            *[p.grad for p in model.parameters()]]


def test_compiled_regions_equal_eager() -> None:
    model = _model()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    want = _step(model, ids)
    counters.clear()
    assert model.compile_regions(backend="aot_eager") is model
    got = _step(model, ids)
    compiled = [name for name, m in model.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == ["blocks.0.attn_norm", "blocks.0.attn", "blocks.0.moe_norm",
                        "blocks.0.moe.router", "blocks.1.attn_norm", "blocks.1.attn",
                        "blocks.1.moe_norm", "blocks.1.moe.router", "norm"]
    assert counters["stats"]["calls_captured"] > 0  # Dynamo traced the regions
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, grad=i >= 2, msg=f"tensor {i}")
