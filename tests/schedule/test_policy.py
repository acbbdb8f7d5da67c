"""ChunkPolicy: fixed c, MACT's budget → c (MemFine Eq. 8-9, hand-worked), errors, agreement.

The budgets are written as ``fixed + m·row`` with the memory model's own fixed and per-row bytes,
so s′_max = m exactly (Eq. 8) whatever those byte counts are; the expected c is then Eq. 9 by hand.
"""

from __future__ import annotations

import warnings

import pytest

from memfine.config import ChunkConfig, MoEConfig
from memfine.memory import layer as layer_memory
from memfine.schedule.policy import ChunkPolicy, identity_agreement
from memfine.units import format_bytes

MOE = MoEConfig(hidden_size=64, intermediate_size=128, num_experts=8, top_k=2)
T, DTYPE_BYTES = 2048, 4


def _fixed_row(recompute: str = "experts") -> tuple[int, int]:
    return (layer_memory.expert_fixed_bytes(T, MOE, DTYPE_BYTES, recompute=recompute),
            layer_memory.expert_row_bytes(MOE, DTYPE_BYTES, recompute=recompute))


def _policy(rows: int, extra_bytes: int = 0, **chunk_kwargs: object) -> ChunkPolicy:
    """A policy whose budget tolerates exactly ``rows`` received rows per chunk."""
    recompute = str(chunk_kwargs.get("recompute", "experts"))
    fixed, row = _fixed_row(recompute)
    chunk = ChunkConfig(memory_budget_bytes=fixed + rows * row + extra_bytes,
                        **chunk_kwargs)  # type: ignore[arg-type]
    return ChunkPolicy(chunk, MOE)


def test_fixed_num_chunks_ignores_the_rows() -> None:
    policy = ChunkPolicy(ChunkConfig(num_chunks=3), MOE, agree_num_chunks=lambda c: 99)
    assert not policy.budgeted
    assert [policy.num_chunks(r, T, DTYPE_BYTES) for r in (0, 10, 10**9)] == [3, 3, 3]


@pytest.mark.parametrize(("recv", "expected"), [
    (0, 1),        # nothing received → smallest bin
    (1000, 1),     # ⌈1000/1000⌉ = 1
    (1001, 2),     # ⌈1001/1000⌉ = 2
    (2000, 2),
    (2001, 4),     # 3 → bin 4
    (4000, 4),
    (4001, 8),     # 5 → bin 8
    (8000, 8),
])
@pytest.mark.parametrize("recompute", ["none", "experts", "full"])
def test_budget_to_num_chunks_eq8_eq9(recv: int, expected: int, recompute: str) -> None:
    policy = _policy(1000, recompute=recompute)
    assert policy.s_prime_max(T, DTYPE_BYTES) == 1000
    assert policy.num_chunks(recv, T, DTYPE_BYTES) == expected


def test_s_prime_max_floors() -> None:
    row = _fixed_row()[1]
    assert _policy(1000, extra_bytes=row - 1).s_prime_max(T, DTYPE_BYTES) == 1000
    assert _policy(1000, extra_bytes=row).s_prime_max(T, DTYPE_BYTES) == 1001


def test_custom_bins() -> None:
    policy = _policy(100, bins=(1, 3, 6))
    assert [policy.num_chunks(r, T, DTYPE_BYTES) for r in (100, 101, 301, 600)] == [1, 3, 6, 6]


def test_infeasible_budget_names_smallest_feasible_budget() -> None:
    fixed, row = _fixed_row()
    policy = _policy(1000)
    need = fixed + 1001 * row  # ⌈8001 / 8⌉ = 1001 rows per chunk with the largest bin
    assert policy.smallest_feasible_budget(8001, T, DTYPE_BYTES) == need
    with pytest.raises(ValueError, match=(
            rf"^ChunkConfig.memory_budget_bytes = {fixed + 1000 * row} bytes "
            rf"\({(fixed + 1000 * row) / 2**20:.2f} MiB\) cannot be met with "
            rf"ChunkConfig.bins \(1, 2, 4, 8\): s''=8001 .* need c=9 > largest bin 8; the "
            rf"smallest feasible budget is {need} bytes \({need / 2**20:.2f} MiB\); raise "
            rf"ChunkConfig.memory_budget_bytes, add a larger bin to ChunkConfig.bins, or set "
            rf"ChunkConfig.allow_over_budget to run with the largest bin$")):
        policy.num_chunks(8001, T, DTYPE_BYTES)
    # the named budget is feasible, one byte less is not
    ok = ChunkPolicy(ChunkConfig(memory_budget_bytes=need), MOE)
    assert ok.num_chunks(8001, T, DTYPE_BYTES) == 8
    with pytest.raises(ValueError, match="cannot be met"):
        ChunkPolicy(ChunkConfig(memory_budget_bytes=need - 1), MOE).num_chunks(8001, T, 4)


def test_budget_below_the_fixed_part() -> None:
    fixed, row = _fixed_row()
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=fixed - 1), MOE)
    assert policy.s_prime_max(T, DTYPE_BYTES) < 0
    need = fixed + 2 * row  # ⌈16/8⌉ = 2 rows per chunk
    with pytest.raises(ValueError, match=f"smallest feasible budget is {need} bytes"):
        policy.num_chunks(16, T, DTYPE_BYTES)


def test_allow_over_budget_uses_largest_bin_and_warns_once() -> None:
    policy = _policy(1000, allow_over_budget=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy.num_chunks(9000, T, DTYPE_BYTES) == 8
        assert policy.num_chunks(20000, T, DTYPE_BYTES) == 8
        assert policy.num_chunks(500, T, DTYPE_BYTES) == 1  # feasible calls stay normal
    assert len(caught) == 1
    assert issubclass(caught[0].category, UserWarning)
    assert "using the largest bin c=8" in str(caught[0].message)
    # a second policy object warns again (once per policy)
    with pytest.warns(UserWarning, match="allow_over_budget"):
        _policy(1000, allow_over_budget=True).num_chunks(9000, T, DTYPE_BYTES)


def test_agreement_hook_gets_local_c_and_its_result_is_used() -> None:
    seen: list[int] = []

    def agree(c: int) -> int:
        seen.append(c)
        return 4  # e.g. another rank of the group needs 4

    fixed, row = _fixed_row()
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=fixed + 1000 * row), MOE,
                         agree_num_chunks=agree)
    assert policy.num_chunks(1500, T, DTYPE_BYTES) == 4
    assert seen == [2]
    policy.agree_num_chunks = lambda c: c  # assignable after construction
    assert policy.num_chunks(1500, T, DTYPE_BYTES) == 2


def test_agreement_on_an_infeasible_rank_is_seen_by_every_rank() -> None:
    """The local value above the largest bin travels through the agreement, so a feasible rank
    raises too (no rank waits for chunks that another rank never runs)."""
    seen: list[int] = []
    infeasible = _policy(1000)
    infeasible.agree_num_chunks = lambda c: seen.append(c) or c  # type: ignore[func-returns-value]
    with pytest.raises(ValueError, match="need c=9"):
        infeasible.num_chunks(8001, T, DTYPE_BYTES)
    assert seen == [9]
    feasible = _policy(1000)
    feasible.agree_num_chunks = lambda c: 9
    with pytest.raises(ValueError, match="another rank of the expert-parallel group needs c=9"):
        feasible.num_chunks(10, T, DTYPE_BYTES)


def test_identity_agreement() -> None:
    assert identity_agreement(7) == 7
    assert ChunkPolicy(ChunkConfig(), MOE).agree_num_chunks is identity_agreement


@pytest.mark.parametrize(("num_bytes", "text"), [
    (512 * 2**20, "536870912 bytes (512.00 MiB)"),
    (3 * 2**29, "1610612736 bytes (1.50 GiB)"),
    (1000, "1000 bytes (0.00 MiB)"),
])
def test_format_bytes_exact(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes, exact=True) == text


def test_negative_rows_rejected() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        _policy(10).num_chunks(-1, T, DTYPE_BYTES)


def test_s_prime_max_needs_a_budget() -> None:
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        ChunkPolicy(ChunkConfig(num_chunks=2), MOE).s_prime_max(T, DTYPE_BYTES)


def test_transport_row_elements_add_to_the_per_row_bytes() -> None:
    """Expert parallelism's received rows: d elements per row on top of the memory model."""
    moe = MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2)
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=1 << 20), moe)
    base = policy.row_bytes(4)
    d = moe.hidden_size
    assert policy.row_bytes(4, transport_row_elements=d) == base + d * 4
    assert policy.row_bytes(2, transport_row_elements=d) == layer_memory.expert_row_bytes(
        moe, 2, recompute="experts") + d * 2
    assert policy.row_bytes(4) == base  # a per-call argument: nothing stays on the policy


def test_transport_row_elements_move_the_chunk_count() -> None:
    """A budget whose s'_max is exactly s'' without transport rows: c = 1 locally, while the
    d extra elements per row of expert parallelism's received x need the next bin (c = 2)."""
    moe = MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2)
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1 << 20), moe)
    rows = 2 * T
    budget = probe.fixed_bytes(T, DTYPE_BYTES) + rows * probe.row_bytes(DTYPE_BYTES)
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=budget), moe)
    assert policy.num_chunks(rows, T, DTYPE_BYTES) == 1
    assert policy.num_chunks(rows, T, DTYPE_BYTES,
                             transport_row_elements=moe.hidden_size) == 2


def test_memory_model_is_asked_once_per_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """One ChunkBytes per (T, D_t); after that Eq. 8/9 are arithmetic on it."""
    calls: list[tuple[int, int]] = []
    real = layer_memory.chunk_bytes

    def counting(num_tokens: int, moe: MoEConfig, dtype_bytes: int, *, recompute: str
                 ) -> layer_memory.ChunkBytes:
        calls.append((num_tokens, dtype_bytes))
        return real(num_tokens, moe, dtype_bytes, recompute=recompute)

    policy = _policy(1000)  # (its budget is built with the memory model: before counting)
    monkeypatch.setattr(layer_memory, "chunk_bytes", counting)
    for recv in (10, 1500, 3000, 10, 8000):
        policy.num_chunks(recv, T, DTYPE_BYTES)
    policy.num_chunks(10, T // 2, DTYPE_BYTES)
    assert calls == [(T, DTYPE_BYTES), (T // 2, DTYPE_BYTES)]
    line = policy.chunk_bytes(T, DTYPE_BYTES)
    assert len(calls) == 2 and (line.fixed_bytes, line.row_bytes) == _fixed_row()


def test_bins_are_capped_at_the_proven_bound() -> None:
    """expert_fixed_bytes bounds the peak for c ≤ MAX_BOUNDED_CHUNKS; larger bins are refused."""
    assert layer_memory.MAX_BOUNDED_CHUNKS == 16
    ChunkConfig(memory_budget_bytes=1, bins=(1, 16))
    with pytest.raises(ValueError, match=r"ChunkConfig.bins must be .* ints in \[1, 16\], "
                                         r"got \(1, 32\)"):
        ChunkConfig(memory_budget_bytes=1, bins=(1, 32))
