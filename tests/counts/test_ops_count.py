"""OpCounter counts a small known program exactly (hand-derived counts), per phase and kind."""

from __future__ import annotations

import pytest
import torch

from memfine.counts.ops_count import SYNC_KINDS, OpCounter


def test_counts_a_known_forward_and_backward_exactly() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 3, requires_grad=True)
    with OpCounter() as counter:
        y = torch.mm(x, w)  # mm
        loss = y.relu().sum()  # relu, sum
        loss.backward()  # seed: ones_like (forward phase, before the graph task)
    fwd, bwd = counter.counts["forward"], counter.counts["backward"]
    assert dict(fwd.ops) == {"aten.mm.default": 1, "aten.relu.default": 1,
                             "aten.sum.default": 1, "aten.ones_like.default": 1}
    # sum backward: expand (view); relu backward: threshold_backward; mm backward: two mm with
    # transposed operands (views); the leaf gradients are accumulated as they are (detach views).
    assert dict(bwd.ops) == {"aten.threshold_backward.default": 1, "aten.mm.default": 2}
    assert fwd.host_syncs == 0 and bwd.host_syncs == 0
    assert bwd.view_ops >= 3  # expand + two t()
    assert counter.total().non_view_ops == 7


def test_counts_each_host_sync_kind_once() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    with OpCounter() as counter:
        x.sum().item()  # item
        bool(x[0, 0] > 1)  # item (bool of a tensor)
        x[0].tolist()  # tolist (never reaches the dispatcher on the CPU)
        x.cpu()  # to_cpu
        x.to("cpu")  # to_cpu
        x.to(torch.float64)  # a cast, not a host copy
        torch.nonzero(x)  # nonzero
        x[x > 5]  # bool_mask_index (aten.index with a bool index)
        x[torch.tensor([0, 2])]  # integer index: no sync
        torch.repeat_interleave(torch.tensor([1, 2]))  # repeat_interleave without output_size
        torch.tensor([1, 2]).repeat_interleave(torch.tensor([1, 2]), output_size=3)  # no sync
        torch.unique(torch.tensor([3, 1, 3]))  # data_dependent
    syncs = counter.counts["forward"].syncs
    assert dict(syncs) == {"item": 2, "tolist": 1, "to_cpu": 2, "nonzero": 1,
                           "bool_mask_index": 1, "repeat_interleave": 1, "data_dependent": 1}
    assert set(syncs) <= set(SYNC_KINDS)


def test_python_level_wrappers_are_restored_and_phase_can_be_forced() -> None:
    tolist = torch.Tensor.tolist
    with OpCounter(phase="backward") as counter:
        torch.ones(2).add_(1)
    assert torch.Tensor.tolist is tolist
    assert counter.counts["backward"].ops["aten.add_.Tensor"] == 1
    assert counter.counts["forward"].non_view_ops == 0
    with pytest.raises(ValueError, match="phase"):
        OpCounter(phase="fwd")


def test_records_grouped_mm_calls_with_their_cuda_verdict() -> None:
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    offs = torch.tensor([2, 2, 8], dtype=torch.int32)  # expert 1 has no rows
    with OpCounter() as counter:
        torch._grouped_mm(x, w, offs=offs)
        torch._grouped_mm(x.float(), w.float(), offs=offs)
    calls = counter.counts["forward"].grouped_mm
    assert [c.layout for c in calls] == ["2d-3d", "2d-3d"]
    assert [c.fast_path for c in calls] == [True, False]
    assert calls[0].groups == 3 and calls[0].empty_groups == 1
    assert "not bf16" in calls[1].problems[0]
    assert counter.counts["forward"].host_syncs == 0  # the rule check reads offsets unseen
