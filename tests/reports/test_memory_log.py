"""Measured step peaks in the training logs: which measurement, and that compiled steps compile."""

from __future__ import annotations

import torch
import torch._dynamo

from memfine.measure import PeakMemoryTracker, ProfiledPeakMemory
from memfine.reports.memory_log import measured_peak

CPU = torch.device("cpu")


def _step(module: torch.nn.Module, x: torch.Tensor) -> None:
    module(x).square().sum().backward()


def test_disabled_measures_nothing() -> None:
    with measured_peak(CPU, False) as got:
        assert got is None


def test_eager_step_uses_the_tracker_and_sees_the_output() -> None:
    layer, x = torch.nn.Linear(64, 64), torch.randn(32, 64)
    with measured_peak(CPU, True) as got:
        _step(layer, x)
    assert isinstance(got, PeakMemoryTracker)
    assert got.peak_bytes >= 32 * 64 * 4  # the (32, 64) fp32 output was alive


def test_compiled_step_is_measured_by_the_profiler_and_still_compiles() -> None:
    # Under the tracker (a TorchDispatchMode) Dynamo captures no graph; under the profiler it does.
    layer, x = torch.nn.Linear(64, 64), torch.randn(32, 64)
    graphs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        fn = torch.compile(layer, backend="aot_eager")
        with measured_peak(CPU, True, compiled=compiled) as got:
            _step(fn, x)
        graphs[compiled] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if compiled:
            assert isinstance(got, ProfiledPeakMemory)
            assert got.peak_bytes >= 32 * 64 * 4
    torch._dynamo.reset()
    assert graphs == {False: 0, True: 1}


def test_prediction_uses_each_layers_own_recompute_mode() -> None:
    """A step-scope plan runs layers with different modes: each layer's prediction is its own."""
    from memfine.config import ChunkConfig, ModelConfig, MoEConfig, TrainConfig
    from memfine.memory.layer import moe_layer_memory
    from memfine.reports.memory_log import predicted_moe_layer_peak

    moe = MoEConfig(hidden_size=32, intermediate_size=64, num_experts=4, top_k=2)
    config = TrainConfig(model=ModelConfig(num_layers=2, num_heads=2, moe=moe,
                                           chunk=ChunkConfig(num_chunks=2, recompute="experts")))
    peaks = {mode: moe_layer_memory(moe, 64, 4, num_chunks=2, recompute=mode).peak_bytes
             for mode in ("none", "experts")}
    assert peaks["none"] != peaks["experts"]
    for mode, want in peaks.items():
        assert predicted_moe_layer_peak(config, 64, 2, mode) == want
    assert predicted_moe_layer_peak(config, 64, 2) == peaks["experts"]  # the config's mode
