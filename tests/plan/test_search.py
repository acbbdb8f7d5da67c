"""Layout search: the fitting set against brute force, the rank rule and the merge of unused
bins, the cost by hand, smallest N and M."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest

from memfine.plan.layout import PlanConfig
from memfine.plan.presets import ModelPreset
from memfine.plan.search import (
    BINS,
    forward_flops_per_token,
    layout_cost,
    layouts,
    nearest_valid_devices,
    parallel_kinds,
    search,
    valid_device_counts,
)
from memfine.plan.stage import plan_layout

TINY = ModelPreset(
    name="tiny", hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2,
    num_layers=4, num_dense_layers=1, dense_intermediate_size=128, num_shared_experts=0,
    shared_intermediate_size=0, num_heads=4, num_kv_heads=4, head_dim=16,
    attention_params=4 * 64 * 64, vocab_size=1000, tied_embeddings=False, source="test")
BASE = PlanConfig(model=TINY, device_memory_bytes=3 << 20, seq_len=64, global_batch=64,
                  dtype="float32")


def _brute_force(base: PlanConfig, devices: int) -> dict[tuple[object, ...], tuple[object, ...]]:
    """Every (t, p, e, dp, cp, b, recompute, bins) by the documented rules, planned one by one,
    → (the c of every stage, the peak): what its plan does."""
    found = {}
    sizes = range(1, devices + 1)
    for t, p, dp, cp, e in itertools.product(sizes, sizes, sizes, (1, 2), range(1, 9)):
        if (t * p * dp * cp != devices or t not in (1, 2, 4, 8) or TINY.num_heads % t
                or p > TINY.num_layers or TINY.num_experts % e or (t * dp * cp) % e
                or base.seq_len % (t * (2 if cp == 2 else 1) * cp)):
            continue
        for b, recompute in itertools.product((1, 2, 4), ("none", "experts", "full")):
            if base.global_batch is not None and base.global_batch % (dp * b):
                continue
            for bins in (BINS if recompute != "none" else BINS[:1]):
                cfg = dataclasses.replace(base, t=t, p=p, dp=dp, cp=cp, e=e, micro_batch=b,
                                          recompute=recompute, bins=bins)
                cfg = dataclasses.replace(cfg, skews=(cfg.worst_skew,))
                plan = plan_layout(cfg)
                if plan.fits:
                    chunks = tuple(sk.num_chunks for st in plan.stages for sk in st.skews)
                    found[(t, p, e, dp, cp, b, recompute, bins)] = (chunks, plan.peak_bytes)
    return found


def _key(cfg: PlanConfig) -> tuple[object, ...]:
    return (cfg.t, cfg.p, cfg.e, cfg.dp, cfg.cp, cfg.micro_batch, cfg.recompute, cfg.bins)


def test_fitting_layouts_equal_brute_force() -> None:
    result = search(BASE, 8)
    got = [_key(c.plan.config) for c in result.fitting]
    expected = _brute_force(BASE, 8)
    assert 0 < len(expected) < result.considered  # the budget separates the layouts
    assert len(got) == len(set(got)) and set(got) <= set(expected)
    # a fitting layout left out has a kept twin with fewer bins and the same plan
    for key in set(expected) - set(got):
        twin = (*key[:7], BINS[0])
        assert key[7] == BINS[1] and twin in got and expected[twin] == expected[key], key
    assert result.merged == len(expected) - len(got) > 0
    times = [round(c.cost.relative_time, 3) for c in result.fitting]
    assert times == sorted(times)
    for c in result.fitting:  # each fits at the worst skew, every stage
        assert c.plan.config.skews == (c.plan.config.worst_skew,) and c.plan.fits
    assert result.smallest_devices is None and result.smallest_device_memory_bytes is None


@pytest.mark.parametrize("seq_len", [62, 63])
def test_sequence_splits_follow_the_trainer_rule(seq_len: int) -> None:
    """s = 62 allows t = 2 but no context parallelism (62 = 2·31); an odd s allows t = cp = 1
    only. The layouts searched are exactly the brute force's."""
    base = dataclasses.replace(BASE, seq_len=seq_len, device_memory_bytes=1 << 40)
    got = {_key(cfg) for cfg in layouts(base, 8)}
    expected = set(_brute_force(base, 8))
    assert got == expected
    assert {(k[0], k[4]) for k in got} == ({(1, 1), (2, 1)} if seq_len == 62 else {(1, 1)})


def test_ties_go_to_fewest_kinds_of_parallelism_then_least_memory() -> None:
    """The RANK_RULE: within a relative time (to 3 decimals), fewer of t, p, e, dp, cp above
    1 first, then the smaller peak."""
    fitting = search(BASE, 8).fitting
    keys = [(round(c.cost.relative_time, 3), parallel_kinds(c.plan.config), c.plan.peak_bytes)
            for c in fitting]
    assert keys == sorted(keys)
    tied = [k for k in keys if k[0] == keys[0][0]]
    assert len({k[1] for k in tied}) > 1  # the tie-break decides here
    assert parallel_kinds(dataclasses.replace(BASE, t=2, e=2, dp=4)) == 3


def test_cost_by_hand() -> None:
    """r = extra forward FLOPs / (3 × forward FLOPs); 1F1B: time (m + p − 1)/m."""
    attention = 2 * 4 * 64 * 64 + 2 * 64 * 4 * 16
    experts = 2 * 2 * 3 * 64 * 32
    moe = attention + 2 * 64 * 8 + experts
    dense = attention + 2 * 3 * 64 * 128
    head = 2 * 64 * 1000
    assert forward_flops_per_token(TINY, 64) == (dense + 3 * moe, 3 * experts, head)
    cfg = dataclasses.replace(BASE, p=2, dp=4, recompute="experts")  # m = 64/4 = 16
    cost = layout_cost(cfg)
    r = 3 * experts / (3 * (dense + 3 * moe + head))
    assert cost.recompute_fraction == pytest.approx(r)
    assert cost.bubble_fraction == pytest.approx(1 / 17)
    assert cost.relative_time == pytest.approx((1 + r) * 17 / 16)
    full = layout_cost(dataclasses.replace(cfg, recompute="full"))
    assert full.recompute_fraction == pytest.approx((dense + 3 * moe) / (3 * (dense + 3 * moe
                                                                              + head)))
    assert layout_cost(dataclasses.replace(cfg, recompute="none")).recompute_fraction == 0


def test_nothing_fits_names_the_smallest_memory_and_devices() -> None:
    tight = dataclasses.replace(BASE, device_memory_bytes=1 << 20)
    result = search(tight, 2)
    assert result.fitting == () and result.considered > 0
    least = result.smallest_device_memory_bytes
    assert least is not None
    # that memory fits some layout on 2 devices; a little less fits none (α = 0.9 rounding)
    assert search(dataclasses.replace(tight, device_memory_bytes=least), 2).fitting
    assert not search(dataclasses.replace(tight, device_memory_bytes=least - 2), 2).fitting
    n = result.smallest_devices
    assert n is not None and n > 2
    frugal = dataclasses.replace(tight, global_batch=None)
    assert search(frugal, n).fitting
    assert n == 4 or not search(frugal, n // 2).fitting


def test_devices_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--devices must be an int >= 1, got 0"):
        search(BASE, 0)


@functools.cache
def _with_a_layout() -> tuple[int, ...]:
    """The device counts below 4096 that have a layout of BASE, one :func:`layouts` each."""
    return tuple(n for n in range(1, 2 * 2048) if any(layouts(BASE, n)))


def test_valid_device_counts_equal_the_layouts() -> None:
    # TINY: t in {1, 2, 4} (4 heads), cp in {1, 2} (s = 64), p <= 4, dp | 64: at most 4·2·4·64
    counts = valid_device_counts(BASE)
    assert counts is not None and counts[-1] == 4 * 2 * 4 * 64 == 2048
    assert set(counts) == set(_with_a_layout())
    assert valid_device_counts(dataclasses.replace(BASE, global_batch=None)) is None


@pytest.mark.parametrize(("devices", "expected"), [
    # by hand: 2^i·3^j with j <= 1 (p = 3), 3·2^i <= 4·2·3·64 = 1536, 2^i <= 2048
    (1, (None, 2)), (8, (6, 12)), (67, (64, 96)), (129, (128, 192)), (1000, (768, 1024)),
    (2047, (1536, 2048)), (2048, (1536, None)), (2049, (2048, None)),
    (10**12, (2048, None)),  # far above the largest count: answered from the set, not a scan
])
def test_nearest_valid_devices(devices: int, expected: tuple[int | None, int | None]) -> None:
    if devices < 2048:  # the nearest counts with a layout, by brute force
        have = _with_a_layout()
        assert expected == (max((n for n in have if n < devices), default=None),
                            min(n for n in have if n > devices))
    assert nearest_valid_devices(BASE, devices) == expected


def test_nearest_valid_devices_without_a_global_batch_are_the_neighbours() -> None:
    free = dataclasses.replace(BASE, global_batch=None)  # dp = N: every count has a layout
    assert nearest_valid_devices(free, 1) == (None, 2)
    assert nearest_valid_devices(free, 10**9 + 7) == (10**9 + 6, 10**9 + 8)


def test_search_on_a_huge_device_count_considers_no_layout() -> None:
    # dp must divide the global batch 64 and p <= 4, so 10^9 devices have no layout; the
    # divisors of N are taken up to L only, not counted one by one up to N
    assert search(BASE, 10**9).considered == 0
