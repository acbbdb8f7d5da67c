"""The bound on kept (token, slot) pairs (memfine.routing.capacity.max_routed_rows), by hand."""

from __future__ import annotations

import pytest
import torch

from memfine.routing import capacity_keep_mask, expert_capacity, max_routed_rows


@pytest.mark.parametrize(("capacity_factor", "min_capacity", "expected"), [
    pytest.param(None, 0, 20, id="dropless_T_times_k"),
    pytest.param(1.0, 0, 20, id="cf1_capacity_5_E_times_5_is_T_times_k"),
    pytest.param(0.5, 0, 12, id="cf0.5_capacity_ceil_2.5_is_3"),
    pytest.param(0.5, 8, 20, id="min_capacity_8_above_ceil"),
    pytest.param(0.1, 0, 4, id="cf0.1_capacity_1"),
])
def test_max_routed_rows_by_hand(capacity_factor: float | None, min_capacity: int,
                                 expected: int) -> None:
    """T = 10, E = 4, k = 2: capacity = min(T, max(min_capacity, ⌈cf·T·k/E⌉))."""
    assert max_routed_rows(10, 4, 2, capacity_factor, min_capacity) == expected


@pytest.mark.parametrize("capacity_factor", [0.1, 0.5, 1.0])
def test_a_balanced_routing_keeps_exactly_the_bound(capacity_factor: float) -> None:
    """T = 8, E = 4, k = 2; token t picks experts t mod E and (t + 1) mod E: each expert is
    offered 4 pairs, at least its capacity, so the kept pairs reach the bound."""
    T, E, k = 8, 4, 2
    top_k_index = torch.tensor([[t % E, (t + 1) % E] for t in range(T)])
    capacity = expert_capacity(T, E, k, capacity_factor)
    keep = capacity_keep_mask(top_k_index, torch.ones(T, k), E, capacity)
    assert int(keep.sum()) == max_routed_rows(T, E, k, capacity_factor)


def test_max_routed_rows_refuses_what_expert_capacity_refuses() -> None:
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        max_routed_rows(10, 4, 2, 0.0)
