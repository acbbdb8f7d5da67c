"""The 4-bit (NF4) base's memory against measurement: resident bytes and the layer's peaks.

Protocol and measurement as tests/memory/test_lora_memory_model.py. One row block: the model is
exact (the block dequantises all E experts); several blocks: at most m experts are dequantised at
once whatever the routing, exact where a block fills its window.
"""

from __future__ import annotations

import pytest
import torch
from test_layer import measure_layer

from memfine.config import MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.memory.lora import lora_layer_memory, quantized_base_bytes
from memfine.nn import MoELayer
from memfine.timeline.quant import resident_bytes

pytest.importorskip("bitsandbytes", reason="the 4-bit base needs bitsandbytes (memfine[qlora])")

F32, BF16 = torch.float32, torch.bfloat16


# (dtype, T, d, n, E, k, c, recompute, peak, lora kwargs)
GRID = [
    pytest.param(F32, 64, 32, 64, 8, 2, 1, "none", "tracker", {}, id="fp32-c1"),
    pytest.param(F32, 64, 32, 64, 8, 2, 1, "none", "profiler", {}, id="fp32-c1-profiler"),
    pytest.param(F32, 64, 32, 64, 8, 2, 2, "experts", "tracker", {}, id="fp32-c2-experts"),
    pytest.param(F32, 64, 32, 64, 8, 2, 1, "none", "tracker", {"targets": ("w_down",)},
                 id="fp32-down-only"),
    pytest.param(BF16, 32, 32, 32, 8, 2, 1, "none", "tracker", {}, id="bf16-c1"),
]


@pytest.mark.parametrize(("dtype", "T", "d", "n", "E", "k", "c", "recompute", "peak", "kw"),
                         GRID)
def test_one_block_model_equals_measurement(dtype: torch.dtype, T: int, d: int, n: int,
                                            E: int, k: int, c: int, recompute: str, peak: str,
                                            kw: dict[str, object]) -> None:
    moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=k,
                    renormalize=True)
    lora = LoRAConfig(rank=4, base_quant="nf4", **kw)  # type: ignore[arg-type]
    measured = measure_layer(moe, T, dtype, c, recompute, lora, peak=peak)
    predicted = lora_layer_memory(moe, lora, T, dtype.itemsize, num_chunks=c,
                                  recompute=recompute)
    assert predicted.saved_bytes == measured.saved_bytes
    assert (predicted.peak_bytes, predicted.forward_peak_bytes) == (
        measured.peak_bytes, measured.forward_peak_bytes)
    # the dequantised experts are transients: the 4-bit layer's peak is above the plain LoRA's
    plain = lora_layer_memory(moe, LoRAConfig(rank=4, **kw), T,  # type: ignore[arg-type]
                              dtype.itemsize, num_chunks=c, recompute=recompute)
    assert predicted.peak_bytes > plain.peak_bytes


# (dtype, rows per block, hot experts, peak, exact), E 32, k 2, T 64: S 128 rows, 4 per expert
# when balanced; m = ⌊B·(3·d + 3·n + G) / (d·G)⌋ = ⌊B·416 / 4096⌋ experts dequantised at once
WINDOWS = [
    pytest.param(F32, 10, 0, "tracker", True, id="uniform-m1"),
    pytest.param(F32, 20, 0, "profiler", True, id="uniform-m2-profiler"),
    pytest.param(BF16, 20, 0, "tracker", True, id="bf16-uniform-m2"),
    # expert 0 takes every token's first slot: the other half of the rows, about 2 per expert,
    # puts 10 or so experts in a block (more than ⌈E·B/S⌉ + 2 = 7, m = 2)
    pytest.param(F32, 20, 1, "profiler", True, id="one-hot-expert-many-per-block"),
    # every row to experts 0 and 1: a block holds at most 2 experts, fewer than m = 4
    pytest.param(F32, 40, 2, "tracker", False, id="two-hot-experts-few-per-block"),
]


@pytest.mark.parametrize(("dtype", "rows", "hot", "peak", "exact"), WINDOWS)
def test_row_blocks_dequantise_at_most_the_window(dtype: torch.dtype, rows: int, hot: int,
                                                  peak: str, exact: bool) -> None:
    """Several row blocks: the model counts m experts; equal to the measurement where a
    block fills the window, above it (never below) where every block holds fewer."""
    d, n, E = 32, 64, 32
    moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=2,
                    renormalize=True, skew_hot_experts=hot, skew_bias=100.0 if hot else 0.0,
                    backward_block_bytes=rows * (3 * d + 3 * n + 2 * n) * dtype.itemsize)
    lora = LoRAConfig(rank=4, base_quant="nf4")
    measured = measure_layer(moe, 64, dtype, 1, "none", lora, peak=peak)
    predicted = lora_layer_memory(moe, lora, 64, dtype.itemsize)
    assert predicted.saved_bytes == measured.saved_bytes
    got = (measured.peak_bytes, measured.forward_peak_bytes)
    want = (predicted.peak_bytes, predicted.forward_peak_bytes)
    if exact:
        assert got == want
    else:
        assert got[0] < want[0] and got[1] < want[1]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_resident_bytes_equal_the_buffers(dtype: torch.dtype) -> None:
    moe = MoEConfig(hidden_size=32, intermediate_size=64, num_experts=8, top_k=2)
    lora = LoRAConfig(rank=4, base_quant="nf4")
    layer = MoELayer(moe, lora=lora).to(dtype)
    held = sum(b.nbytes for b in layer.experts.buffers())
    assert held == resident_bytes(8, 32, 64, moe.up_width) == quantized_base_bytes(moe, lora)
    assert not any(n in ("w_up", "w_down") for n, _ in layer.experts.named_parameters())
    bf16 = 8 * 32 * (moe.up_width + 64) * 2
    assert held <= 0.3 * bf16
