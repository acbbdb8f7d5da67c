"""Whole-model memory (MemFine Eq. 1-2): pipeline layout, in-flight chunks, static bytes."""

from __future__ import annotations

import dataclasses

import pytest

from memfine.plan.layout import PlanConfig, in_flight_chunks, stage_layers
from memfine.plan.presets import get_preset
from memfine.plan.stage import (
    layer_activation,
    plan_layout,
    plan_stage,
    recv_rows,
    static_memory,
)

TINY = dataclasses.replace(
    get_preset("olmoe-1b-7b"), hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2,
    num_layers=4, num_heads=2, num_kv_heads=2, head_dim=4, attention_params=100, vocab_size=10)


def test_stage_layers_interleaved() -> None:
    assert stage_layers(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert stage_layers(5, 2, 1) == [[[0, 1, 2]], [[3, 4]]]


@pytest.mark.parametrize(("p", "v", "rank", "m_g"), [
    (1, 1, 0, 1), (4, 1, 0, 4), (4, 1, 3, 1), (4, 2, 0, 11), (4, 2, 3, 5)])
def test_in_flight_chunks(p: int, v: int, rank: int, m_g: int) -> None:
    """1F1B keeps p − r micro-batches; interleaved v·p + p − 2r − 1 chunks (MemFine Eq. 2)."""
    assert in_flight_chunks(p, v, rank) == m_g


def test_static_memory_by_hand() -> None:
    """4 MoE layers on one rank, t=1, e=2 (2 local experts), dp=2: Eq. 1 per parameter."""
    cfg = PlanConfig(model=TINY, device_memory_bytes=1 << 30, e=2, dp=2)
    st = static_memory(cfg, 0)
    per_layer_dense = 100 + 2 * 8 + 4 * 8  # attention, two norms, router
    assert st.dense_params == 4 * per_layer_dense + 10 * 8 + 10 * 8 + 8  # embeddings, final norm
    assert st.expert_params == 4 * 2 * 3 * 8 * 4
    n = st.dense_params + st.expert_params
    assert st.parameter_bytes == 2 * n and st.gradient_bytes == 4 * n
    # dense state sharded over dp·cp = 2, expert state over t·dp·cp/e = 1
    assert st.optimizer_state_bytes == 12 * st.dense_params // 2 + 12 * st.expert_params
    assert st.static_bytes == st.parameter_bytes + st.gradient_bytes + st.optimizer_state_bytes


def test_layer_activation_table2_widths() -> None:
    cfg = PlanConfig(model=TINY, device_memory_bytes=1 << 30, seq_len=16, t=2, dp=2)
    moe = layer_activation(cfg, moe_layer=True)
    assert moe.attention_bytes == 2 * 16 * (5 * 8 + 2 * 4 + 2 * 2 * 4 + 4) // 2  # /(t·cp)
    assert moe.expert_row_bytes == 2 * (2 * 8 + 2 * 4)  # per row; rows carry the /(t·cp)
    assert moe.layer_input_bytes == 2 * 16 * 8 // 2


@pytest.mark.parametrize(("b", "t", "cp", "skew", "rows"), [
    (1, 1, 1, 1.0, 32),       # s·k = 16·2
    (2, 1, 1, 1.0, 64),       # the micro-batch counts
    (2, 2, 1, 1.5, 48),       # ⌈2·16·2·1.5 / 2⌉
    (1, 1, 2, 99.0, 32),      # capped at the worst skew e·min(k, E/e)/k = 2 (e = 2)
])
def test_recv_rows(b: int, t: int, cp: int, skew: float, rows: int) -> None:
    cfg = PlanConfig(model=TINY, device_memory_bytes=1 << 30, seq_len=16, micro_batch=b, t=t,
                     cp=cp, e=2, dp=2)
    assert recv_rows(cfg, skew) == rows


@pytest.mark.parametrize(("p", "v"), [(4, 1), (2, 2), (3, 1)])
def test_plan_layout_equals_each_stage(p: int, v: int) -> None:
    """plan_layout computes each distinct stage once; every rank equals its own plan_stage."""
    model = dataclasses.replace(TINY, num_layers=8, num_dense_layers=1,
                                dense_intermediate_size=16)
    cfg = PlanConfig(model=model, device_memory_bytes=1 << 20, seq_len=16, p=p, v=v,
                     skews=(1.0, 2.0))
    plan = plan_layout(cfg)
    assert plan.stages == tuple(plan_stage(cfg, r) for r in range(p))
    assert plan.peak_bytes == max(sk.total_bytes for st in plan.stages for sk in st.skews)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("e", 3, "PlanConfig.e must be a divisor of num_experts=4"),
    ("alpha", 1.5, r"PlanConfig.alpha must be in \(0, 1\]"),
    ("skews", (0.5,), "PlanConfig.skews must be"),
    ("bins", (2, 1), "PlanConfig.bins must be"),
    ("recompute", "some", "PlanConfig.recompute must be one of"),
    ("v", 2, r"PlanConfig.v must be 1 when p = 1"),
])
def test_plan_config_rejects(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlanConfig(model=TINY, device_memory_bytes=1 << 30, **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("t", "cp", "seq_len"), [(2, 1, 63), (1, 2, 6), (2, 2, 36)])
def test_plan_config_rejects_a_sequence_the_splits_do_not_divide(t: int, cp: int,
                                                                 seq_len: int) -> None:
    """s must be a multiple of t·(2·cp if cp > 1 else 1): 63 over t = 2, 6 into 2·2 pieces,
    36 over 2·(2·2) = 8."""
    with pytest.raises(ValueError, match=r"PlanConfig.seq_len must be a multiple of"):
        PlanConfig(model=TINY, device_memory_bytes=1 << 30, t=t, cp=cp, dp=2, seq_len=seq_len)
    PlanConfig(model=TINY, device_memory_bytes=1 << 30, t=t, cp=cp, dp=2,
               seq_len=t * (2 * cp if cp > 1 else 1) * 3)


def test_presets_use_the_moe_config_field_names() -> None:
    from memfine.plan.presets import PRESETS

    ds = PRESETS["deepseek-v3"].moe_config()
    assert (ds.num_experts, ds.top_k, ds.n_group, ds.topk_group, ds.score_func,
            ds.routed_scaling_factor, ds.num_shared_experts, ds.shared_width) == (
        256, 8, 8, 4, "sigmoid", 2.5, 1, 2048)  # DeepSeek-V3 config.json
    for preset in PRESETS.values():
        moe = preset.moe_config()  # validates every preset's routing fields
        assert moe.num_experts == preset.num_experts and moe.top_k == preset.top_k
