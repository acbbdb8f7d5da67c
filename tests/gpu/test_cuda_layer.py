"""One MoELayer on CUDA: allocator peak against the memory model, autocast and torch.compile.

Peak: ``torch.cuda.max_memory_allocated`` after a reset (measure_backward on ``cuda``) against
:func:`memfine.memory.layer.moe_layer_memory`, within CUDA_PEAK_RTOL / CUDA_PEAK_ATOL_BYTES
(tests/tolerances.py says why it is wider than the CPU's PEAK_RTOL). Saved bytes are exact.
"""

from __future__ import annotations

import pytest
import torch

from devices import gpu
from memfine.config import ChunkConfig, MoEConfig
from memfine.measure import measure_backward
from memfine.memory.layer import moe_layer_memory
from memfine.nn import MoELayer
from tolerances import CUDA_PEAK_ATOL_BYTES, CUDA_PEAK_RTOL, assert_close

pytestmark = gpu
MOE = MoEConfig(hidden_size=512, intermediate_size=384, num_experts=16, top_k=4)
T = 4096


def _layer(moe: MoEConfig = MOE, chunk: ChunkConfig | None = None,
           dtype: torch.dtype = torch.float32) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(moe, chunk=chunk or ChunkConfig()).to("cuda", dtype)


@pytest.mark.parametrize(("dtype", "num_chunks", "recompute"), [
    (torch.bfloat16, 1, "none"), (torch.bfloat16, 4, "experts"), (torch.float32, 1, "none"),
], ids=["bf16-c1", "bf16-c4-experts", "fp32-c1"])
def test_cuda_peak_matches_the_memory_model(dtype: torch.dtype, num_chunks: int,
                                            recompute: str) -> None:
    layer = _layer(chunk=ChunkConfig(num_chunks=num_chunks, recompute=recompute), dtype=dtype)
    x = torch.randn(T, MOE.hidden_size, device="cuda", dtype=dtype, requires_grad=True)
    grads = [torch.randn_like(x), torch.tensor(0.01, device="cuda"),
             torch.tensor(0.001, device="cuda")]
    kept: list[object] = []

    def forward() -> list[torch.Tensor]:
        out, aux = layer(x)
        kept[:] = [aux]
        return [out, aux.load_balancing_loss, aux.z_loss]

    measured = measure_backward(forward, grads, device="cuda", exclude=layer.parameters())
    # the layer runs CUDA's default row blocks, which the model resolves for device_type
    predicted = moe_layer_memory(MOE, T, dtype.itemsize, device_type="cuda",
                                 num_chunks=num_chunks, recompute=recompute)
    assert measured.saved_bytes == predicted.saved_bytes
    assert measured.peak_bytes is not None
    gap = abs(measured.peak_bytes - predicted.peak_bytes)
    assert gap <= max(CUDA_PEAK_RTOL * measured.peak_bytes, CUDA_PEAK_ATOL_BYTES), (
        predicted.peak_bytes, measured.peak_bytes)


def test_bf16_autocast_matches_fp32() -> None:
    layer = _layer()
    x = torch.randn(512, MOE.hidden_size, device="cuda", requires_grad=True)
    want, _ = layer(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, aux = layer(x)
    assert got.dtype == torch.bfloat16 and aux.load_balancing_loss.dtype == torch.float32
    assert_close(got.double(), want.double(), dtype=torch.bfloat16)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in layer.parameters() if p.requires_grad)


@pytest.mark.parametrize("chunk", [ChunkConfig(), ChunkConfig(num_chunks=2, recompute="experts")],
                         ids=["c1", "c2-experts"])
def test_compiled_layer_matches_eager(chunk: ChunkConfig) -> None:
    layer = _layer(chunk=chunk)
    x = torch.randn(512, MOE.hidden_size, device="cuda")
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, _ = layer(eager_x)
    want.sum().backward()
    compiled = torch.compile(layer)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got, _ = compiled(compiled_x)
    got.sum().backward()
    assert_close(got, want)
    assert compiled_x.grad is not None and eager_x.grad is not None
    assert_close(compiled_x.grad, eager_x.grad, grad=True)
