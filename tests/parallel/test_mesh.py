"""init_parallel: under nccl each torchrun process takes the GPU of its LOCAL_RANK first.

torch.cuda's device functions and the process-group set-up are stand-ins here (no GPU, no
nccl on this machine); the one-rank nccl run is tests/gpu/test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

from memfine.parallel import mesh


@pytest.fixture
def devices(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mesh, "build_context", lambda dp_shard, ep: (dp_shard, ep))
    return chosen


@pytest.mark.parametrize(("local_rank", "want"), [(None, 0), ("0", 0), ("3", 3)])
def test_nccl_sets_the_device_of_local_rank(devices: list[int], local_rank: str | None,
                                            want: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert mesh.init_parallel(1, 1, backend="nccl") == (1, 1)
    assert devices == [want]


def test_gloo_leaves_the_device(devices: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    mesh.init_parallel(1, 1, backend="gloo")
    assert devices == []


@pytest.mark.parametrize("local_rank", ["4", "-1", "one"])
def test_bad_local_rank_is_named(devices: list[int], local_rank: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(ValueError, match=rf"LOCAL_RANK must be an int in \[0, 4\) .* got "
                                         rf"'{local_rank}'"):
        mesh.init_parallel(1, 1, backend="nccl")
    assert devices == []
