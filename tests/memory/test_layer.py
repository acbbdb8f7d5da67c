"""The MoE-layer memory model against measurement: saved bytes exact, peak within PEAK_RTOL.

Protocol (the model's): x exists before and requires grad, parameters have no ``.grad``, the
output and the two aux losses get gradients that exist before; saved bytes are counted by the
saved-tensor hooks during forward, peak bytes by the live-storage tracker over forward + backward.
Skewed routing sends every token to experts 0..k-1 (the router's selection-bias knob).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from memfine.activations import ACTIVATIONS
from memfine.config import ChunkConfig, MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.measure import MemoryReport, measure_backward
from memfine.memory.layer import (
    MemoryBreakdown,
    builder_switch_tokens,
    expert_row_bytes,
    layer_peak_bytes,
    mode_settings,
    moe_layer_memory,
    saved_items,
)
from memfine.nn import MoELayer
from memfine.schedule import ChunkPolicy
from tolerances import PEAK_RTOL

F32, BF16 = torch.float32, torch.bfloat16


def _layer_config(d: int, n: int, E: int, k: int, *, skewed: bool, impl: str,
                  activation: str = "swiglu") -> MoEConfig:
    return MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=k,
                     renormalize=k > 1, experts_impl=impl, activation=activation,
                     skew_hot_experts=k if skewed else 0, skew_bias=100.0 if skewed else 0.0)


def measure_layer(moe: MoEConfig, T: int, dtype: torch.dtype, num_chunks: int,
                  recompute: str, lora: LoRAConfig | None = None,
                  peak: str = "tracker") -> MemoryReport:
    """Measured saved and peak bytes of one MoELayer forward + backward (the model's protocol).

    ``peak``: ``tracker`` (the live-storage tracker) or ``profiler`` (torch.profiler).
    """
    layer = MoELayer(moe, chunk=ChunkConfig(num_chunks=num_chunks, recompute=recompute),
                     lora=lora)
    layer = layer.to(dtype)
    x = torch.randn(T, moe.hidden_size, dtype=dtype, requires_grad=True)
    grads = [torch.randn(T, moe.hidden_size, dtype=dtype), torch.tensor(0.01),
             torch.tensor(0.001)]

    kept: list[object] = []  # the caller keeps MoEAux (its counters), as the model's protocol says

    def forward() -> list[torch.Tensor]:
        out, aux = layer(x)
        kept[:] = [aux]
        return [out, aux.load_balancing_loss, aux.z_loss]

    return measure_backward(forward, grads, exclude=layer.parameters(), peak=peak)


# (dtype, T, d, n, E, k, skewed, mode, c): ≥ 12 layer configurations over dtypes, k, E, routing
# and every execution mode; bf16 sizes stay tiny (bf16 matmuls are slow on this CPU).
GRID = [
    pytest.param(F32, 96, 32, 32, 16, 1, False, "fused", 1, id="fp32-k1-E16-balanced-fused"),
    pytest.param(F32, 96, 32, 32, 16, 1, True, "plain", 1, id="fp32-k1-E16-skewed-plain"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, "full", 1, id="fp32-k2-E8-balanced-full-c1"),
    pytest.param(F32, 64, 32, 64, 8, 2, True, "chunked", 2, id="fp32-k2-E8-skewed-chunked-c2"),
    pytest.param(F32, 64, 32, 64, 8, 2, False, "chunked", 4,
                 id="fp32-k2-E8-balanced-chunked-c4"),
    pytest.param(F32, 72, 16, 16, 64, 8, False, "chunked", 8,
                 id="fp32-k8-E64-balanced-chunked-c8"),
    pytest.param(F32, 72, 16, 16, 64, 8, True, "fused", 1, id="fp32-k8-E64-skewed-fused"),
    pytest.param(F32, 48, 16, 32, 32, 8, False, "plain", 1, id="fp32-k8-E32-balanced-plain"),
    pytest.param(F32, 77, 32, 16, 64, 2, True, "chunked", 8,
                 id="fp32-k2-E64-skewed-chunked-c8-T_not_divisible_by_c"),
    pytest.param(F32, 64, 32, 64, 8, 2, True, "full", 1, id="fp32-k2-E8-skewed-full-c1"),
    pytest.param(BF16, 32, 16, 16, 8, 2, False, "fused", 1, id="bf16-k2-E8-balanced-fused"),
    pytest.param(BF16, 32, 16, 16, 8, 2, True, "chunked", 4, id="bf16-k2-E8-skewed-chunked-c4"),
    pytest.param(BF16, 24, 16, 8, 64, 8, True, "full", 1, id="bf16-k8-E64-skewed-full-c1"),
    pytest.param(BF16, 32, 16, 16, 4, 1, False, "plain", 1, id="bf16-k1-E4-balanced-plain"),
    pytest.param(BF16, 24, 16, 16, 16, 8, False, "chunked", 2,
                 id="bf16-k8-E16-balanced-chunked-c2"),
    pytest.param(BF16, 24, 16, 8, 64, 8, False, "chunked", 8,
                 id="bf16-k8-E64-balanced-chunked-c8"),
]


@pytest.mark.parametrize(("dtype", "T", "d", "n", "E", "k", "skewed", "mode", "c"), GRID)
def test_model_matches_measurement(dtype: torch.dtype, T: int, d: int, n: int, E: int, k: int,
                                   skewed: bool, mode: str, c: int) -> None:
    impl, num_chunks, recompute = mode_settings(mode, c)
    moe = _layer_config(d, n, E, k, skewed=skewed, impl=impl)
    measured = measure_layer(moe, T, dtype, num_chunks, recompute)
    predicted = moe_layer_memory(moe, T, dtype.itemsize, num_chunks=num_chunks,
                                 recompute=recompute)
    assert predicted.saved_bytes == measured.saved_bytes
    assert measured.peak_bytes is not None
    assert abs(predicted.peak_bytes / measured.peak_bytes - 1) <= PEAK_RTOL, (
        predicted.peak_bytes, measured.peak_bytes)
    assert predicted.forward_peak_bytes == pytest.approx(measured.forward_peak_bytes,
                                                         rel=PEAK_RTOL)


# (T, d, n, E, k, impl, c, recompute, shared experts): fp32 layers whose peak is where the
# autograd engine adds a gradient into another one in place (the router's and the experts' dx of
# x at the end of backward, the logits' gradients, the engine-summed weight gradients of plain
# chunks) or where gather / index_select backward scatter into their zeros in place. Under a
# dispatch mode (the live tracker) these run out of place, so the tracker peaks above the program
# there; the model replays the program and equals torch.profiler to the byte.
PROFILED = [
    pytest.param(96, 16, 8, 64, 8, "fused", 8, "experts", False,
                 id="k8-E64-chunked-c8-fine-grained"),
    pytest.param(96, 64, 8, 8, 1, "fused", 8, "experts", False, id="k1-chunked-c8"),
    pytest.param(96, 64, 8, 8, 2, "fused", 4, "experts", False, id="k2-chunked-c4"),
    pytest.param(48, 64, 8, 8, 1, "fused", 1, "none", False, id="k1-fused"),
    pytest.param(48, 64, 8, 8, 1, "plain", 1, "none", False, id="k1-plain"),
    pytest.param(48, 16, 16, 64, 1, "plain", 2, "none", False, id="k1-E64-plain-c2"),
    pytest.param(192, 16, 8, 64, 2, "fused", 4, "experts", True, id="k2-shared-gate-c4"),
]


@pytest.mark.parametrize(("T", "d", "n", "E", "k", "impl", "c", "recompute", "shared"), PROFILED)
def test_peak_equals_the_profiler_where_the_engine_adds_in_place(
        T: int, d: int, n: int, E: int, k: int, impl: str, c: int, recompute: str,
        shared: bool) -> None:
    moe = _layer_config(d, n, E, k, skewed=False, impl=impl)
    if shared:
        moe = dataclasses.replace(moe, num_shared_experts=1, shared_intermediate_size=n,
                                  shared_expert_gate=True)
    measured = measure_layer(moe, T, F32, c, recompute, peak="profiler")
    predicted = moe_layer_memory(moe, T, 4, num_chunks=c, recompute=recompute)
    assert predicted.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("activation", sorted(set(ACTIVATIONS) - {"swiglu"}))
@pytest.mark.parametrize("mode", ["plain", "fused", "chunked"])
def test_activations(activation: str, mode: str) -> None:
    """Every named activation of the one table: saved bytes and the profiler's peak exact."""
    impl, c, recompute = mode_settings(mode, 3)
    moe = _layer_config(32, 24, 6, 2, skewed=False, impl=impl, activation=activation)
    measured = measure_layer(moe, 40, F32, c, recompute, peak="profiler")
    predicted = moe_layer_memory(moe, 40, 4, num_chunks=c, recompute=recompute)
    assert predicted.saved_bytes == measured.saved_bytes
    assert predicted.peak_bytes == measured.peak_bytes


def test_fused_saved_items_by_hand() -> None:
    """T=10, d=8, n=4 (G=8), E=4, k=2, fp32, fused, softmax with renormalisation.

    The router node saves x and the (T, k) selection only: no scores, renormalisation inputs
    or loss tensors (docs/design.md §2)."""
    moe = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2)
    items = saved_items(moe, 10, 4)
    S = 20
    assert items["layer_input_bytes"] == 10 * 8 * 4
    assert items["top_k_index_bytes"] == 10 * 2 * 8
    assert items["top_k_weights_bytes"] == 10 * 2 * 4
    assert items["pre_activation_bytes"] == S * 8 * 4
    assert items["routing_index_bytes"] == 4 * (2 * S + 20 + 5)
    assert sum(items.values()) == 320 + 160 + 80 + 640 + 260
    capacity = saved_items(dataclasses.replace(moe, capacity_factor=2.0), 10, 4)
    assert capacity["top_k_index_bytes"] == 2 * 10 * 2 * 8  # the masked index too


def test_recompute_keeps_only_input_and_routing() -> None:
    """Full/chunked recompute: the expert part saves nothing (docs/design.md §5)."""
    moe = MoEConfig(hidden_size=64, intermediate_size=128, num_experts=8, top_k=2)
    fused = saved_items(moe, 256, 4)
    for c in (1, 2, 8):
        chunked = saved_items(moe, 256, 4, num_chunks=c, recompute="experts")
        assert chunked["pre_activation_bytes"] == chunked["routing_index_bytes"] == 0
        expert_part = fused["pre_activation_bytes"] + fused["routing_index_bytes"]
        assert sum(fused.values()) - sum(chunked.values()) == expert_part


def test_breakdown_fields_and_sources() -> None:
    moe = MoEConfig(hidden_size=32, intermediate_size=64, num_experts=8, top_k=2)
    b = moe_layer_memory(moe, 64, 4, optimizer_bytes_per_param=8)
    for f in dataclasses.fields(MemoryBreakdown):
        if f.name == "assumptions":
            continue
        assert f.name.endswith("_bytes") and isinstance(getattr(b, f.name), int)
        assert f.metadata["tensor"] and f.metadata["source"]
    saved = saved_items(moe, 64, 4)
    assert b.saved_bytes == sum(saved.values())
    assert b.total_bytes == b.parameter_bytes + b.optimizer_state_bytes + b.peak_bytes
    assert b.optimizer_state_bytes == b.parameter_bytes // 4 * 8
    assert b.peak_bytes == max(b.forward_peak_bytes, b.backward_peak_bytes)
    assert any("all-to-all" in a for a in b.assumptions)
    assert [r[0] for r in b.rows()][:3] == ["parameter_bytes", "gradient_bytes",
                                            "optimizer_state_bytes"]


@pytest.mark.parametrize(("c", "skewed"), [(1, False), (2, True), (4, False), (8, True)])
def test_layer_peak_bytes_is_the_measured_peak(c: int, skewed: bool) -> None:
    """MACT's number (the timeline's peak) against the measured layer peak, any routing."""
    moe = _layer_config(32, 64, 8, 2, skewed=skewed, impl="fused")
    T = 96
    measured = measure_layer(moe, T, F32, c, "experts").peak_bytes
    assert measured is not None
    assert layer_peak_bytes(moe, T, 4, num_chunks=c, recompute="experts") == pytest.approx(
        measured, rel=PEAK_RTOL)


def test_the_row_slope_bounds_every_added_row() -> None:
    """expert_row_bytes is the largest per-row growth of the layer peak between chunk sizes."""
    moe = MoEConfig(hidden_size=16, intermediate_size=48, num_experts=32, top_k=4)
    row = expert_row_bytes(moe, 2)
    peaks = [layer_peak_bytes(moe, T, 2, num_chunks=1, recompute="experts") for T in (40, 41, 80)]
    assert peaks[1] - peaks[0] <= row * moe.top_k
    assert peaks[2] - peaks[0] <= row * moe.top_k * 40


def test_chunking_divides_the_expert_transients() -> None:
    moe = MoEConfig(hidden_size=64, intermediate_size=256, num_experts=8, top_k=2)
    one = moe_layer_memory(moe, 1024, 4, num_chunks=1, recompute="experts")
    eight = moe_layer_memory(moe, 1024, 4, num_chunks=8, recompute="experts")
    assert eight.transient_pre_activation_grad_bytes * 8 == one.transient_pre_activation_grad_bytes
    assert eight.peak_bytes < one.peak_bytes


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_tokens": -1}, "num_tokens must be >= 0"),
    ({"dtype_bytes": 3}, "dtype_bytes must be 2, 4 or 8"),
    ({"num_chunks": 0}, "num_chunks must be >= 1"),
    ({"recompute": "some"}, "recompute must be"),
])
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args = {"num_tokens": 8, "dtype_bytes": 4, "num_chunks": 1, "recompute": "none"} | kwargs
    moe = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=match):
        moe_layer_memory(moe, args["num_tokens"], args["dtype_bytes"],  # type: ignore[arg-type]
                         num_chunks=args["num_chunks"],  # type: ignore[arg-type]
                         recompute=args["recompute"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode must be one of"):
        mode_settings("other")
    with pytest.raises(ValueError, match="needs num_chunks >= 2"):
        mode_settings("chunked", 1)


@pytest.mark.parametrize("T", [256, 1024, 2048, 8192, 16384])
def test_chunked_peak_not_above_unchunked(T: int) -> None:
    """Shared chunk weight-gradient buffers: c ∈ {2, 4, 8} holds no second one (model).

    The model equals torch.profiler's peak on every layer mode (tests/measure/test_profiled.py);
    before the shared buffer, c = 2 at T = 256 peaked at fused + one weight-gradient size. From
    T = 1,024 every c peaks at or below c = 1; at T = 256, where c = 1 frees its first block's H
    before its last, smaller block (394 of 1,024 rows) peaks, c = 2's one block of 512 rows
    peaks within one block's transients above it.
    """
    moe = MoEConfig(hidden_size=512, intermediate_size=1024, num_experts=16, top_k=4)
    fused = moe_layer_memory(moe, T, 4).peak_bytes
    grads_bytes = 16 * 512 * 1024 * 3 * 4  # w_up (E, d, 2n) + w_down (E, n, d), fp32
    for c in (2, 4, 8):
        chunked = moe_layer_memory(moe, T, 4, num_chunks=c, recompute="experts").peak_bytes
        assert grads_bytes < chunked < fused + grads_bytes // 3, (c, chunked, fused)  # w_down's
        assert T < 1024 or chunked <= fused, (c, chunked, fused)


@pytest.mark.parametrize(("dtype", "mode", "c", "gate"), [
    pytest.param(F32, "fused", 1, False, id="fp32-fused"),
    pytest.param(F32, "fused", 1, True, id="fp32-fused-gate"),
    pytest.param(F32, "plain", 1, False, id="fp32-plain"),
    pytest.param(F32, "plain", 1, True, id="fp32-plain-gate"),
    pytest.param(F32, "chunked", 3, True, id="fp32-chunked-c3-gate"),
    pytest.param(BF16, "full", 1, False, id="bf16-full"),
    pytest.param(BF16, "plain", 1, True, id="bf16-plain-gate"),
    pytest.param(BF16, "chunked", 2, False, id="bf16-chunked-c2"),
])
def test_shared_experts_match_measurement(dtype: torch.dtype, mode: str, c: int,
                                          gate: bool) -> None:
    impl, num_chunks, recompute = mode_settings(mode, c)
    moe = dataclasses.replace(_layer_config(16, 16, 8, 2, skewed=False, impl=impl),
                              num_shared_experts=2, shared_intermediate_size=12,
                              shared_expert_gate=gate)
    measured = measure_layer(moe, 24, dtype, num_chunks, recompute)
    predicted = moe_layer_memory(moe, 24, dtype.itemsize, num_chunks=num_chunks,
                                 recompute=recompute)
    assert predicted.saved_bytes == measured.saved_bytes
    assert predicted.shared_expert_bytes + predicted.shared_weights_bytes > 0
    assert measured.peak_bytes is not None
    assert abs(predicted.peak_bytes / measured.peak_bytes - 1) <= PEAK_RTOL
    assert predicted.forward_peak_bytes == pytest.approx(measured.forward_peak_bytes,
                                                         rel=PEAK_RTOL)


@pytest.mark.parametrize(("T", "c", "recompute", "block"), [
    pytest.param(64, 1, "none", 10_000, id="bf16-fused-blocks"),
    pytest.param(72, 4, "experts", 4_500, id="bf16-chunked-c4-blocks"),
    pytest.param(64, 2, "none", 3_000, id="bf16-chunked-c2-no-recompute-blocks"),
])
def test_bf16_grouped_weight_grad_transients_match_the_tracker_exactly(
        T: int, c: int, recompute: str, block: int) -> None:
    """bf16 weight gradients with several row blocks are written once (per-expert products
    into their slices, a first block of half the rows as one grouped GEMM that is the buffer)
    plus fp32 sums of the experts cut by block edges: the model's peak equals the live-storage
    tracker's to the byte (the profiler also sees bf16 kernels' fp32 workspaces,
    tests/measure/test_profiled.py)."""
    moe = MoEConfig(hidden_size=32, intermediate_size=64, num_experts=8, top_k=2,
                    backward_block_bytes=block)
    measured = measure_layer(moe, T, BF16, c, recompute)
    predicted = moe_layer_memory(moe, T, 2, num_chunks=c, recompute=recompute)
    assert (predicted.peak_bytes, predicted.forward_peak_bytes) == (
        measured.peak_bytes, measured.forward_peak_bytes)


MONOTONE_SHAPES = {
    "fused": MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2),
    "plain": MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2,
                       experts_impl="plain"),
    "argsort-relu": MoEConfig(hidden_size=16, intermediate_size=24, num_experts=4, top_k=2,
                              index_builder="argsort", activation="relu"),
    "shared": MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2,
                        num_shared_experts=1, shared_expert_gate=True),
    "blocks-k1": MoEConfig(hidden_size=8, intermediate_size=24, num_experts=8, top_k=1,
                           renormalize=False, backward_block_bytes=12 * 832),
}


@pytest.mark.parametrize("shape", list(MONOTONE_SHAPES))
def test_layer_peak_grows_with_the_token_count(shape: str) -> None:
    """MACT's thresholds T_max(c) (``ChunkPolicy.token_limits``) bisect over T: the exact peak
    never falls when T grows, for every dtype, recompute mode and chunk count of the grid
    (T = 0 … 96 one by one, then around each power of two up to 2^13)."""
    moe = MONOTONE_SHAPES[shape]
    tokens = [*range(97), *(2**i + j for i in range(7, 14) for j in (-1, 0, 1))]
    for dt, recompute, c in itertools.product((2, 4, 8), ("none", "experts", "full"),
                                              (1, 2, 3, 8)):
        peaks = [layer_peak_bytes(moe, T, dt, num_chunks=c, recompute=recompute)
                 for T in tokens]
        switches = builder_switch_tokens(moe, c)  # the index builder turns: it may fall there
        assert all(a <= b for a, b, T in zip(peaks, peaks[1:], tokens, strict=False)
                   if T not in switches), (dt, recompute, c)


def test_mact_thresholds_admit_no_token_count_that_does_not_fit() -> None:
    """On the CPU the index builder turns at 32,768 dense-map cells (T 8192 at E 4), where this
    layer's peak falls (its k = 2 builder outweighs the router node's recompute): T_max stops
    below the turn though larger T fit again."""
    moe = MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2,
                    renormalize=False, backward_block_bytes=12 * 832)
    (turn,) = builder_switch_tokens(moe, 1)
    at_turn = layer_peak_bytes(moe, turn, 2, num_chunks=1, recompute="experts")
    assert layer_peak_bytes(moe, turn + 1, 2, num_chunks=1, recompute="experts") < at_turn
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=at_turn - 1, bins=(1,),
                                     recompute="experts"), moe)
    (limit,) = policy.token_limits(2)
    assert limit < turn
    assert all(layer_peak_bytes(moe, T, 2, num_chunks=1, recompute="experts") < at_turn
               for T in range(limit - 3, limit + 1))


ROUTERS = [
    pytest.param({}, id="softmax"),
    pytest.param({"renormalize": False}, id="softmax-no-renorm"),
    pytest.param({"score_func": "sigmoid", "renormalize": False}, id="sigmoid-no-renorm"),
    pytest.param({"score_func": "sigmoid"}, id="sigmoid-renorm"),
    pytest.param({"score_func": "sqrtsoftplus"}, id="sqrtsoftplus-renorm"),
    pytest.param({"score_func": "sqrtsoftplus", "renormalize": False},
                 id="sqrtsoftplus-no-renorm"),
    pytest.param({"score_func": "sigmoid", "n_group": 4, "topk_group": 2}, id="group-limited"),
    pytest.param({"routed_scaling_factor": 2.5}, id="softmax-scaled"),
    pytest.param({"score_func": "sigmoid", "routed_scaling_factor": 2.5},
                 id="sigmoid-renorm-scaled"),
    pytest.param({"score_func": "sqrtsoftplus", "routed_scaling_factor": 2.5,
                  "renormalize": False}, id="sqrtsoftplus-no-renorm-scaled"),
    # capacity = T (cf = E): no pair is dropped, s″ = T·k as the model counts
    pytest.param({"capacity_factor": 16.0}, id="capacity-by-probability"),
    pytest.param({"capacity_factor": 16.0, "drop_policy": "position"},
                 id="capacity-by-position"),
    pytest.param({"capacity_factor": 16.0, "score_func": "sqrtsoftplus",
                  "routed_scaling_factor": 2.5}, id="capacity-sqrtsoftplus-scaled"),
]
# (T, E, k): two shapes, so a match is not a coincidence of one size
ROUTER_SHAPES = [pytest.param(64, 8, 2, id="T64-E8-k2"), pytest.param(48, 16, 4, id="T48-E16-k4")]


@pytest.mark.parametrize(("T", "E", "k"), ROUTER_SHAPES)
@pytest.mark.parametrize("routing", ROUTERS)
def test_every_router_kind_is_exact_against_the_profiler(routing: dict[str, object], T: int,
                                                         E: int, k: int) -> None:
    """fp32, fused, d 32, n 64: saved bytes and the profiler's peak, to the byte."""
    moe = dataclasses.replace(_layer_config(32, 64, E, k, skewed=False, impl="fused"),
                              **routing)  # type: ignore[arg-type]
    measured = measure_layer(moe, T, F32, 1, "none", peak="profiler")
    predicted = moe_layer_memory(moe, T, 4)
    assert (predicted.saved_bytes, predicted.peak_bytes) == (measured.saved_bytes,
                                                             measured.peak_bytes)


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
def test_capacity_that_drops_pairs_is_bounded_by_the_model(drop_policy: str) -> None:
    """Skewed routing at cf 1: experts 0 and 1 keep ⌈T·k/E⌉ of their T pairs each.

    The expert part then holds fewer rows than the model's s″ = T·k, so the model is an upper
    bound; the saved bytes differ by the dropped rows' expert tensors only.
    """
    moe = dataclasses.replace(_layer_config(32, 64, 8, 2, skewed=True, impl="fused"),
                              capacity_factor=1.0, drop_policy=drop_policy)
    measured = measure_layer(moe, 64, F32, 1, "none", peak="profiler")
    predicted = moe_layer_memory(moe, 64, 4)
    assert measured.peak_bytes is not None
    assert measured.saved_bytes < predicted.saved_bytes
    assert measured.peak_bytes < predicted.peak_bytes
