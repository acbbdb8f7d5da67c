"""The LoRA MoE layer's memory model against measurement: saved bytes and peaks exact.

Protocol and measurement as tests/memory/test_layer.py (``measure_layer``). The layer is
MoELayer(lora=...): frozen base, router (unless trained) and shared experts (unless
``train_attention``), per-expert adapters, split LoRA.
"""

from __future__ import annotations

import pytest
import torch
from test_layer import measure_layer

from memfine.config import MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.memory.layer import moe_layer_memory
from memfine.memory.lora import lora_layer_memory

F32, BF16 = torch.float32, torch.bfloat16


# (dtype, T, d, n, E, k, skewed, c, recompute, lora kwargs)
GRID = [
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none", {}, id="fp32-c1"),
    pytest.param(F32, 64, 32, 64, 8, 2, True, 2, "experts", {}, id="fp32-skewed-c2-experts"),
    pytest.param(F32, 77, 32, 64, 8, 2, False, 4, "experts", {}, id="fp32-c4-T77"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, 2, "none", {}, id="fp32-c2-no-recompute"),
    pytest.param(F32, 48, 16, 32, 32, 8, False, 1, "full", {"rank": 2}, id="fp32-k8-full"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none", {"targets": ("w_down",)},
                 id="fp32-down-only"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none", {"targets": ("w_up",)},
                 id="fp32-up-only"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none", {"train_router": True},
                 id="fp32-router-trained"),
    pytest.param(BF16, 32, 16, 16, 8, 2, False, 1, "none", {}, id="bf16-c1"),
    pytest.param(BF16, 32, 16, 16, 8, 2, False, 1, "none", {"train_router": True},
                 id="bf16-router-trained"),
    pytest.param(BF16, 72, 32, 64, 8, 2, True, 4, "experts", {"rank": 8},
                 id="bf16-skewed-c4-r8"),
    # row blocks of a few rows: the adapters' forward terms are streamed with the blocks
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none", {"block_bytes": 4096},
                 id="fp32-row-blocks"),
    pytest.param(F32, 77, 32, 64, 8, 2, True, 2, "none",
                 {"block_bytes": 3000, "targets": ("w_up",)}, id="fp32-row-blocks-c2-up-only"),
    pytest.param(BF16, 72, 32, 64, 8, 2, False, 2, "experts", {"block_bytes": 2048},
                 id="bf16-row-blocks-c2-experts"),
    # shared experts: frozen (no weight gradients, A not recomputed without a gate) unless
    # train_attention
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none", {"shared": 1}, id="fp32-shared"),
    pytest.param(F32, 64, 32, 64, 8, 2, True, 2, "experts", {"shared": 1, "gate": True},
                 id="fp32-shared-gate-c2-experts"),
    pytest.param(BF16, 32, 16, 16, 8, 2, False, 1, "none", {"shared": 1, "gate": True},
                 id="bf16-shared-gate"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, 1, "none",
                 {"shared": 1, "gate": True, "train_attention": True},
                 id="fp32-shared-gate-trained"),
]


@pytest.mark.parametrize(("dtype", "T", "d", "n", "E", "k", "skewed", "c", "recompute", "kw"),
                         GRID)
def test_lora_layer_model_equals_measurement(dtype: torch.dtype, T: int, d: int, n: int, E: int,
                                             k: int, skewed: bool, c: int, recompute: str,
                                             kw: dict[str, object]) -> None:
    kw = dict(kw)
    moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=k,
                    renormalize=True, skew_hot_experts=k if skewed else 0,
                    skew_bias=100.0 if skewed else 0.0,
                    backward_block_bytes=kw.pop("block_bytes", None),  # type: ignore[arg-type]
                    num_shared_experts=kw.pop("shared", 0),  # type: ignore[arg-type]
                    shared_expert_gate=kw.pop("gate", False))  # type: ignore[arg-type]
    lora = LoRAConfig(**{"rank": 4, **kw})  # type: ignore[arg-type]
    measured = measure_layer(moe, T, dtype, c, recompute, lora)
    predicted = lora_layer_memory(moe, lora, T, dtype.itemsize, num_chunks=c,
                                  recompute=recompute)
    assert predicted.saved_bytes == measured.saved_bytes
    assert (predicted.peak_bytes, predicted.forward_peak_bytes) == (
        measured.peak_bytes, measured.forward_peak_bytes)
    # the adapters' U: S·r per adapter and chunk, unless the chunks are recomputed
    rows = T * k * lora.rank * len(lora.targets) * dtype.itemsize
    assert predicted.adapter_saved_bytes == (0 if recompute != "none" else rows)


def test_frozen_base_lowers_the_peak_below_the_trained_layer() -> None:
    """No base weight gradient: the LoRA layer's backward peak is far below full training's.

    (Full training frees its one block's H once dH exists, before its peak: the margin is
    H (S·2n) below the weight gradients, 0.3 of them here.)
    """
    moe = MoEConfig(hidden_size=64, intermediate_size=128, num_experts=16, top_k=2)
    full = moe_layer_memory(moe, 256, 4)
    tuned = lora_layer_memory(moe, LoRAConfig(rank=8), 256, 4)
    weight_grads = 16 * 64 * 128 * 3 * 4
    assert full.peak_bytes - tuned.peak_bytes >= weight_grads // 4
    assert tuned.saved_bytes - full.saved_bytes == 256 * 2 * 8 * 2 * 4  # U_up and U_down


def test_plain_experts_are_refused() -> None:
    moe = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                    experts_impl="plain")
    with pytest.raises(ValueError, match="experts_impl='fused'"):
        lora_layer_memory(moe, LoRAConfig(rank=2), 8, 4)


def test_mact_budget_on_a_lora_layer_uses_the_lora_peak() -> None:
    """MACT picks c from the LoRA layer's peak; the measured peak is the predicted one."""
    from memfine.config import ChunkConfig
    from memfine.nn import MoELayer

    moe = MoEConfig(hidden_size=32, intermediate_size=64, num_experts=8, top_k=2,
                    renormalize=True)
    lora = LoRAConfig(rank=4)
    T = 96
    peaks = {c: lora_layer_memory(moe, lora, T, 4, num_chunks=c, recompute="experts").peak_bytes
             for c in (1, 2, 4, 8)}
    assert peaks[1] > peaks[2] > peaks[4]
    budget = (peaks[2] + peaks[4]) // 2  # c = 4 is the smallest bin that fits
    layer = MoELayer(moe, chunk=ChunkConfig(memory_budget_bytes=budget, recompute="experts"),
                     lora=lora)
    x = torch.randn(T, 32, requires_grad=True)
    out, aux = layer(x)
    decision = layer.policy.last_decision
    assert decision is not None and decision.num_chunks == 4
    assert decision.predicted_peak_bytes == peaks[4] <= budget
    del out, aux
    measured = measure_layer(moe, T, torch.float32, 4, "experts", lora)
    assert measured.peak_bytes == peaks[4]
