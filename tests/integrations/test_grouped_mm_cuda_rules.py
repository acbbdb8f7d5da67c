"""Every bf16 ``torch._grouped_mm`` call memfine makes would take CUDA's CUTLASS fast path.

Counted with :class:`memfine.counts.ops_count.OpCounter` on the CPU, whose rule check reads each
call's real operands (16-byte-aligned pointers and strides, < 1024 groups, the 2-D/3-D layout
and empty-group rules of PyTorch's CUDA kernel). Covers the fused forward and backward (several
row blocks, chunked), the plain path and its weight gradients, the transformers experts backend
and the torchtitan converter, with experts that receive no rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from memfine.config import ChunkConfig, MoEConfig
from memfine.counts.grouped_mm_rules import GroupedMMCall
from memfine.counts.ops_count import OpCounter
from memfine.nn import MoELayer

BF16 = torch.bfloat16
# T·k = 12 rows over E = 16 experts: at least 4 experts get no rows.
T, D, N, E, K = 6, 32, 16, 16, 2


def _calls(run: Callable[[], None]) -> list[GroupedMMCall]:
    with OpCounter() as counter:
        run()
    return counter.total().grouped_mm


def _layer_run(moe: MoEConfig, chunk: ChunkConfig | None = None) -> Callable[[], None]:
    layer = MoELayer(moe, chunk=chunk).to(BF16)
    x = torch.randn(T, D, dtype=BF16, requires_grad=True)

    def run() -> None:
        out, aux = layer(x)
        (out.float().square().sum() + aux.load_balancing_loss + aux.z_loss).backward()

    return run


MOE = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
LAYERS = {
    "fused": (MOE, None),
    # one row per block: (3·d + 3·n + 2n)·2 bytes
    "fused_row_blocks": (dataclasses.replace(MOE, backward_block_bytes=(3 * D + 5 * N) * 2),
                         None),
    "fused_chunked": (MOE, ChunkConfig(num_chunks=2, recompute="experts")),
    "plain": (dataclasses.replace(MOE, experts_impl="plain", gemm_backend="grouped_mm"), None),
}


def _assert_fast(calls: list[GroupedMMCall]) -> None:
    assert calls, "no torch._grouped_mm call was made"
    bad = [(c.layout, c.a_shape, c.b_shape, c.problems) for c in calls if not c.fast_path]
    assert not bad, bad
    assert all(c.dtype == "torch.bfloat16" for c in calls)


@pytest.mark.parametrize("name", list(LAYERS))
def test_moe_layer_calls_take_the_fast_path(name: str) -> None:
    calls = _calls(_layer_run(*LAYERS[name]))
    _assert_fast(calls)
    assert {c.phase for c in calls} == {"forward", "backward"}
    if name == "fused_row_blocks":  # one-row blocks: each GEMM takes its one expert only
        assert all(c.groups == 1 for c in calls if c.layout == "2d-3d")
    else:
        assert any(c.empty_groups for c in calls)  # zero-row experts were in the calls


def test_plain_path_weight_gradients_are_2d_2d_calls_with_empty_groups() -> None:
    calls = _calls(_layer_run(*LAYERS["plain"]))
    grads = [c for c in calls if c.layout == "2d-2d"]
    assert len(grads) == 2 and all(c.empty_groups for c in grads)  # dW_up, dW_down


def test_transformers_experts_backend_calls_take_the_fast_path() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    from memfine.bench.options import BenchOptions, LayerShape
    from memfine.integrations.transformers import make_config, memfine_experts_forward
    from memfine.suites import hf

    shape = LayerShape(name="tiny", tokens=T, hidden_size=D, intermediate_size=N,
                       num_experts=E, top_k=K)
    opts = BenchOptions(suites=("hf",), dtype="bfloat16")
    for model_type in hf.MODULES:
        experts = hf.make_experts(shape, opts, torch.device("cpu"), model_type)
        inp = hf.make_inputs(shape, opts, torch.device("cpu"))
        for num_chunks in (None, 2):
            def run(experts=experts, inp=inp, num_chunks=num_chunks) -> None:
                out = memfine_experts_forward(experts, inp["x"], inp["index"], inp["weights"],
                                              config=make_config(num_chunks=num_chunks))
                out.backward(inp["grad"])

            calls = _calls(run)
            _assert_fast(calls)
            assert any(c.empty_groups for c in calls)


def test_torchtitan_converter_calls_take_the_fast_path() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    from torchtitan_models import build_moe

    from memfine.integrations import torchtitan as mf_tt

    moe = build_moe("qwen3", dtype=BF16, dim=D, hidden=N, num_experts=E, top_k=K)
    mf_tt.convert_model(moe)
    x = torch.randn(1, T, D, dtype=BF16, requires_grad=True)
    calls = _calls(lambda: moe(x).float().square().sum().backward())
    _assert_fast(calls)
    assert any(c.empty_groups for c in calls)
