"""The peak tracker and the memory model against ``torch.profiler``'s allocator events.

``torch.profiler(profile_memory=True)`` is the CPU ground truth: it does not change what the
program does. The live-storage tracker (a TorchDispatchMode) does in one place: the autograd
engine sums two gradients of one tensor out of place under any dispatch mode (test below). On
memfine's MoE layer (plain, fused, chunked, recomputed, forward and backward streamed over
several row blocks) the tracker, the profiler and the memory model's timeline give the same peak
and forward-peak bytes, exactly (the bytes alive between phases may differ by a scalar the
profiler sees and the tracker does not: Python-created scalar tensors bypass the dispatcher).
"""

from __future__ import annotations

import pytest
import torch

from memfine.config import ChunkConfig, MoEConfig
from memfine.measure import (
    PeakMemoryTracker,
    ProfiledPeakMemory,
    measure_backward,
    measure_memory,
    profiled_peak_bytes,
)
from memfine.memory.layer import moe_layer_memory
from memfine.nn import MoELayer


def test_profiled_counts_allocations_marks_and_phases() -> None:
    keep = torch.zeros(100)  # alive before the region, freed inside: not counted
    with ProfiledPeakMemory() as prof:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        del keep
        prof.mark("forward")
        del a
        c = torch.empty(250, dtype=torch.int32)  # 1000 bytes
    assert (prof.peak_bytes, prof.current_bytes) == (8000, 5000)
    assert prof.marks == {"forward": 8000}
    assert prof.phase_peaks == {"forward": 8000, "end": 8000}
    assert profiled_peak_bytes(lambda: torch.empty(10).add(torch.ones(10))) == 3 * 40
    del b, c


def test_profiled_misuse_raises() -> None:
    prof = ProfiledPeakMemory()
    with pytest.raises(RuntimeError, match="inside the with block"):
        prof.mark("x")
    with prof, pytest.raises(RuntimeError, match="only after the with block"):
        _ = prof.peak_bytes
    with pytest.raises(RuntimeError, match="entered only once"), prof:
        pass
    with pytest.raises(ValueError, match="peak must be one of"), measure_memory(peak="rss"):
        pass


def test_dispatch_mode_makes_the_engine_sum_gradients_out_of_place() -> None:
    """w used twice: the engine adds the second gradient in place, except under the tracker."""
    w = torch.randn(128, 64, requires_grad=True)
    x1, x2 = torch.randn(4, 128), torch.randn(4, 128)

    def step() -> None:
        ((x1 @ w).sum() + (x2 @ w).sum()).backward()
        w.grad = None

    with PeakMemoryTracker() as tracker:
        step()
    with ProfiledPeakMemory() as prof:
        step()
    grad_bytes = w.numel() * 4
    # the profiler: the first gradient and the incoming one; the tracker: also their sum
    assert 2 * grad_bytes <= prof.peak_bytes < 3 * grad_bytes <= tracker.peak_bytes


# (T, d, n, E, k, impl, c, recompute, backward block bytes): every execution mode; the small
# block target makes the fused backward run in several row blocks (blocks cut experts).
GRID = [
    pytest.param(64, 32, 64, 8, 2, "plain", 1, "none", 2**26, id="plain"),
    pytest.param(64, 32, 64, 8, 2, "fused", 1, "none", 2**26, id="fused"),
    pytest.param(64, 32, 64, 8, 2, "fused", 1, "none", 30_000, id="fused-blocks"),
    pytest.param(64, 32, 64, 8, 2, "fused", 2, "experts", 2**26, id="chunked-c2"),
    pytest.param(72, 16, 32, 16, 4, "fused", 4, "experts", 9_000, id="chunked-c4-blocks"),
    pytest.param(77, 32, 16, 8, 2, "fused", 3, "none", 2**26, id="chunked-c3-no-recompute"),
    pytest.param(64, 32, 64, 8, 2, "fused", 1, "experts", 2**26, id="recompute-c1"),
    # the streamed forward at k 8: many row blocks, a last short one. (Where the experts'
    # forward transients fall below the router's z-loss temporaries, e.g. d 32, n 16, E 32, c 2
    # or the fused-blocks shape above with 20,000-byte blocks,
    # the forward peak is the z-loss's logsumexp, which the profiler sees and the tracker and the
    # model do not: those shapes are left out here.)
    pytest.param(40, 64, 32, 16, 8, "fused", 1, "none", 6_000, id="k8-blocks"),
    pytest.param(40, 64, 32, 16, 8, "fused", 2, "none", 6_000, id="k8-c2-blocks"),
    pytest.param(40, 64, 32, 16, 8, "fused", 4, "experts", 6_000, id="k8-c4-recompute-blocks"),
]


def _measure(moe: MoEConfig, T: int, c: int, recompute: str, peak: str) -> tuple[int, ...]:
    torch.manual_seed(0)
    layer = MoELayer(moe, chunk=ChunkConfig(num_chunks=c, recompute=recompute))  # type: ignore[arg-type]
    x = torch.randn(T, moe.hidden_size, requires_grad=True)
    grads = [torch.randn(T, moe.hidden_size), torch.tensor(0.01), torch.tensor(0.001)]
    kept: list[object] = []

    def forward() -> list[torch.Tensor]:
        out, aux = layer(x)
        kept[:] = [aux]
        return [out, aux.load_balancing_loss, aux.z_loss]

    r = measure_backward(forward, grads, exclude=layer.parameters(), peak=peak)
    assert r.peak_bytes is not None and r.forward_peak_bytes is not None
    return r.peak_bytes, r.forward_peak_bytes


@pytest.mark.parametrize(("T", "d", "n", "E", "k", "impl", "c", "recompute", "block"), GRID)
def test_tracker_profiler_and_model_agree(T: int, d: int, n: int, E: int, k: int, impl: str,
                                          c: int, recompute: str, block: int) -> None:
    moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=k,
                    experts_impl=impl, backward_block_bytes=block)  # type: ignore[arg-type]
    tracker = _measure(moe, T, c, recompute, "tracker")
    profiler = _measure(moe, T, c, recompute, "profiler")
    model = moe_layer_memory(moe, T, 4, num_chunks=c, recompute=recompute)
    assert tracker == profiler
    assert (model.peak_bytes, model.forward_peak_bytes) == profiler



def test_bf16_profiler_sees_kernel_workspaces_the_tracker_does_not() -> None:
    """bf16 on the CPU: the profiler peaks above the tracker (and the model, which replays
    tensors only), because CPU bf16 kernels allocate fp32 workspaces inside the operator, below
    the dispatcher. The fp32 grid above is where all three agree to the byte."""
    moe = MoEConfig(hidden_size=32, intermediate_size=64, num_experts=8, top_k=2)
    torch.manual_seed(0)
    layer = MoELayer(moe).to(torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(64, 32, dtype=torch.bfloat16), torch.tensor(0.01), torch.tensor(0.001)]

    def forward() -> list[torch.Tensor]:
        out, aux = layer(x)
        return [out, aux.load_balancing_loss, aux.z_loss]

    tracker = measure_backward(forward, grads, exclude=layer.parameters(), peak="tracker")
    profiler = measure_backward(forward, grads, exclude=layer.parameters(), peak="profiler")
    assert tracker.peak_bytes is not None and profiler.peak_bytes is not None
    assert profiler.peak_bytes > tracker.peak_bytes
