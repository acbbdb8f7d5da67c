"""A layer call resolves its rows per row block once, and the experts run those rows.

The config's ``backward_block_bytes`` (None: the device default) or a budget's ladder rung meets
the layer's d, n, G and D_t in the chunk policy; the experts functions receive an int
``block_rows`` and never resolve bytes themselves. The expected rows come from
:func:`memfine.config.backward_block_rows` on the byte targets, for the routed experts and for
shared experts of another width (which run the call's byte target at their own row bytes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfine.experts.run as run_module
import memfine.nn.experts as experts_module
from memfine.config import ChunkConfig, MoEConfig, backward_block_rows, budget_block_ladder
from memfine.memory.layer import layer_peak_bytes
from memfine.nn import MoELayer
from spies import record_kwarg

D, N, N_S, E, K, T = 256, 1024, 128, 4, 2, 1024  # S = T·k = 2,048 routed rows
MOE = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K,
                num_shared_experts=1, shared_intermediate_size=N_S)
ROW = (3 * D + 3 * N + 2 * N) * 4  # fp32 bytes of one routed block row
SET = 5 * ROW + 7  # a set byte target: 5 routed rows
RUNG = budget_block_ladder(None, "cpu", ROW)[2]  # a quarter of the CPU default's rows


def _want(block_bytes: int | None) -> list[int]:
    """The rows the routed, then the shared experts run for a byte target (None: default)."""
    return [backward_block_rows(block_bytes, D, N, 2 * N, 4),
            backward_block_rows(block_bytes, D, N_S, 2 * N_S, 4)]


def _budget() -> int:
    """A budget met at c = 1 by the quarter rung and not by the half rung."""
    def peak(block: int) -> int:
        return layer_peak_bytes(dataclasses.replace(MOE, backward_block_bytes=block), T, 4,
                                recompute="experts")

    half = budget_block_ladder(None, "cpu", ROW)[1]
    assert peak(half) > peak(RUNG)
    return peak(RUNG)


@pytest.mark.parametrize("case", ["default", "set_bytes", "budget_rung"])
def test_the_experts_receive_the_rows_of_the_configs_bytes_or_the_budgets_rung(
        monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    moe = dataclasses.replace(MOE, backward_block_bytes=SET) if case == "set_bytes" else MOE
    chunk = ChunkConfig(memory_budget_bytes=_budget()) if case == "budget_rung" else ChunkConfig()
    want = _want({"default": None, "set_bytes": SET, "budget_rung": RUNG}[case])
    assert want[0] != want[1]  # the shared experts' rows are their own

    def no_bytes(*args: object) -> int:
        raise AssertionError("the experts resolved a byte target themselves")

    monkeypatch.setattr(run_module, "backward_block_rows", no_bytes)
    rows = record_kwarg(monkeypatch, experts_module, "run_experts", "block_rows")
    torch.manual_seed(0)
    layer = MoELayer(moe, chunk=chunk)
    with torch.no_grad():
        layer(torch.randn(T, D))
    decision = layer.last_decision
    assert decision is not None and decision.num_chunks == 1
    assert decision.block_rows == want[0]
    assert rows == want  # routed, then shared: ints, resolved once by the layer's policy
