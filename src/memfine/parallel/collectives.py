"""Collectives of expert parallelism: a differentiable uneven all-to-all and the chunk agreement.

Legend: M rows this rank sends, S rows it receives, D features (any trailing shape).
gloo supports uneven and zero splits in ``all_to_all_single`` (the list form rejects uneven sizes);
the backward pass is the inverse all-to-all with the split sizes swapped.
Reference: docs/design.md §8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device for small bookkeeping tensors of a collective: CUDA under nccl, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    out_SD = x_MD.new_empty((sum(out_splits), *x_MD.shape[1:]))
    dist.all_to_all_single(out_SD, x_MD.contiguous(), out_splits, in_splits, group=group)
    return out_SD


class AllToAllFunction(torch.autograd.Function):
    """Rows ``x[sum(in_splits[:j]) : sum(in_splits[:j+1])]`` go to rank j of ``group``.

    forward(x_MD, out_splits, in_splits, group) → out_SD with S = sum(out_splits), the rows from
    rank 0 first, then rank 1, ...

    Saved for backward: nothing but the two split lists (Python ints).
    Recomputed in backward: nothing; backward is the inverse all-to-all of the gradient
    (a collective: every rank of the group must run it).
    """

    @staticmethod
    def forward(ctx: Any, x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        """Exchange the rows of x_MD; only the split lists and the group are kept in ``ctx``."""
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x_MD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad_out_SD: torch.Tensor) -> tuple[Any, ...]:
        """The inverse all-to-all of the gradient (splits swapped); None for the other inputs."""
        grad_x_MD = _exchange(grad_out_SD, ctx.in_splits, ctx.out_splits, ctx.group)
        # None: out_splits, in_splits, group
        return grad_x_MD, None, None, None


def all_to_all(x_MD: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: dist.ProcessGroup | None = None, *, check: bool = True) -> torch.Tensor:
    """Exchange rows with every rank of ``group``; differentiable.

    Args:
        x_MD: (M, ...) rows grouped by destination rank, M = sum(in_splits).
        out_splits: rows to receive from each rank (len = group size), ints ≥ 0.
        in_splits: rows to send to each rank (len = group size), ints ≥ 0.
        group: process group (default: the world).
        check: agree the splits across the ranks first (:func:`check_splits`). False only
            where the splits come from an exchange of the counts (the EP engine's chunk plans).

    Returns:
        (sum(out_splits), ...) new tensor, rows ordered by source rank.

    Raises:
        ValueError: if M != sum(in_splits) or a split list has the wrong length (this rank
            only); on every rank of the group, when the ranks' splits disagree (rank i expects
            out_splits[j] rows from rank j, which sends in_splits[i] to it).

    Side effects: with ``check``, one ``all_gather`` of 2·W int64 (the split check); one
    ``all_to_all_single`` on ``group`` (one more in backward, with the checked splits).
    """
    out_list, in_list = [int(v) for v in out_splits], [int(v) for v in in_splits]
    size = dist.get_world_size(group)
    if len(out_list) != size or len(in_list) != size:
        raise ValueError(f"split sizes must have one entry per rank ({size}), got "
                         f"out_splits={out_list}, in_splits={in_list}")
    if x_MD.shape[0] != sum(in_list):
        raise ValueError(f"x must have sum(in_splits)={sum(in_list)} rows, got {x_MD.shape[0]}")
    if check:
        check_splits(out_list, in_list, group)
    out: torch.Tensor = AllToAllFunction.apply(x_MD, out_list, in_list, group)
    return out


def check_splits(out_splits: list[int], in_splits: list[int],
                 group: dist.ProcessGroup | None = None) -> None:
    """Check that every rank's splits match the others'; a collective (call on every rank).

    Every rank gathers all ranks' (in_splits, out_splits), so all reach the same verdict and
    raise the same error, before any row is exchanged.

    Raises:
        ValueError: on every rank, naming the first pair of ranks that disagree.
    """
    size = len(out_splits)
    mine = torch.tensor([*in_splits, *out_splits], dtype=torch.int64,
                        device=collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()  # (W, 2W): row r = rank r's in_splits, out_splits
    sent_WW, expected_WW = table[:, :size], table[:, size:]
    bad = (sent_WW != expected_WW.t()).nonzero()
    if bad.numel():
        src, dst = (int(v) for v in bad[0])
        raise ValueError(f"all_to_all splits disagree across ranks: rank {src} sends "
                         f"{int(sent_WW[src, dst])} rows to rank {dst}, which expects "
                         f"{int(expected_WW[dst, src])} from it (in_splits of a rank must "
                         f"match the others' out_splits)")


def agree_num_chunks(num_chunks: int, group: dist.ProcessGroup | None = None, *,
                     require_equal: bool = False) -> int:
    """Agree on one chunk count across ``group``: the maximum of every rank's choice.

    Every chunk issues its own dispatch and combine all-to-all, so all ranks of an EP group must
    run the same number of chunks, or a rank would wait for a chunk that never comes.

    Args:
        num_chunks: this rank's chunk count c (≥ 1).
        group: the EP group (default: the world).
        require_equal: check instead of agree: every rank must already hold the same c.

    Returns:
        max over the group of c.

    Raises:
        ValueError: with ``require_equal``, on every rank of the group, when the ranks' chunk
            counts differ (running on would hang).

    Side effects: one ``all_reduce(MAX)`` of two int64 (c and -c) on ``group``.
    Reference: MemFine §4 (the chunk count is the same on all ranks of the EP group).
    """
    c = torch.tensor([int(num_chunks), -int(num_chunks)], dtype=torch.int64,
                     device=collective_device(group))
    dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
    c_max, c_min = int(c[0]), -int(c[1])
    if require_equal and c_max != c_min:
        raise ValueError(f"ranks of the expert-parallel group run different chunk counts "
                         f"(from {c_min} to {c_max}); use the same num_chunks on every rank, or "
                         f"a memory budget (the ranks then agree on the group maximum)")
    return c_max
