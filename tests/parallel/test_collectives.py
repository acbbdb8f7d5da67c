"""The uneven all-to-all refuses splits that disagree across ranks, on every rank (gloo, 2 ranks).

Without the check gloo fails on one rank and aborts the other (SIGABRT) mid-exchange.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ep_harness import check_outcome, run_scenarios, spawn

from memfine.parallel import all_to_all

pytestmark = pytest.mark.distributed


def _message_of(fn: Any) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    x_MD = torch.arange(4, dtype=torch.float64)[:, None] + 10 * rank

    def disagree() -> str:  # rank 1 expects 3 rows from rank 0, which sends 2
        in_splits, out_splits = [[2, 2], [1, 3]][rank], [[2, 1], [3, 3]][rank]
        return _message_of(lambda: all_to_all(x_MD, out_splits, in_splits))

    def agree_after() -> list[float]:  # the group stays usable after the refusal
        in_splits, out_splits = [[2, 2], [1, 3]][rank], [[2, 1], [2, 3]][rank]
        return all_to_all(x_MD, out_splits, in_splits)[:, 0].tolist()

    return run_scenarios({"splits_disagree": disagree, "splits_agree_after": agree_after})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_two_ranks, 2, tmp_path_factory.mktemp("a2a"))


def test_disagreeing_splits_raise_on_every_rank(results: list[dict[str, Any]]) -> None:
    messages = check_outcome(results, "splits_disagree")
    want = ("all_to_all splits disagree across ranks: rank 0 sends 2 rows to rank 1, which "
            "expects 3 from it (in_splits of a rank must match the others' out_splits)")
    assert messages == [want, want]
    assert check_outcome(results, "splits_agree_after") == [[0.0, 1.0, 10.0],
                                                            [2.0, 3.0, 11.0, 12.0, 13.0]]
