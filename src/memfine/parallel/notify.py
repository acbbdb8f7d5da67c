"""The count exchange ("notify") of expert parallelism, and the frozen per-chunk dispatch plan.

Legend: T tokens, K top-k slots, E experts (global), L experts on this rank (E/e), P ranks of the
EP group (e), C chunk rows (one per chunk of every candidate chunk count), M routed rows this rank
sends (valid (token, slot) pairs, ≤ T·k), S rows this rank's experts receive (s″).

One ``all_to_all_single`` of int64 counts per layer call gives every rank its received rows per
source rank and local expert, for each chunk of every candidate c at once (bins 1, 2, 4, 8: 15
rows of L counts per destination); the agreed c's split sizes need no other exchange, and
recompute reuses them: no count exchange ever runs inside recompute.
Reference: MemFine §4 (router → notify → chunks); docs/design.md §4.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memfine.dispatch import RoutingIndex, build_routing_index
from memfine.parallel.collectives import collective_device
from memfine.schedule.chunked import chunk_sizes


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """``(start, stop)`` token ranges of the c chunks of :func:`memfine.schedule.chunk_sizes`."""
    sizes = chunk_sizes(num_tokens, num_chunks)
    stops = itertools.accumulate(sizes)
    return [(stop - size, stop) for size, stop in zip(sizes, stops, strict=True)]


def chunk_expert_counts(top_k_index: torch.Tensor, num_experts: int,
                        num_chunks: int) -> torch.Tensor:
    """Routed rows per (chunk, expert) of this rank's tokens.

    Args:
        top_k_index: (T, k) int64 global expert ids; ids outside [0, E) are sentinels (not sent).
        num_experts: E.
        num_chunks: c.

    Returns:
        (c, E) int64 counts on top_k_index's device.
    """
    T = top_k_index.shape[0]
    dev = top_k_index.device
    chunk_T = torch.empty(T, dtype=torch.int64, device=dev)
    for i, (start, stop) in enumerate(chunk_bounds(T, num_chunks)):
        chunk_T[start:stop] = i
    idx_TK = top_k_index.long()
    valid_TK = (idx_TK >= 0) & (idx_TK < num_experts)
    key_TK = chunk_T[:, None] * num_experts + idx_TK
    return torch.bincount(key_TK[valid_TK], minlength=num_chunks * num_experts).view(
        num_chunks, num_experts)


@dataclass(frozen=True, slots=True)
class ExpertCounts:
    """Per-chunk routed-row counts, sent and received, for every candidate chunk count.

    Attributes:
        candidates: chunk counts whose per-chunk counts were exchanged, e.g. (1, 2, 4, 8).
        send_counts_CE: (sum(candidates), E) int64 CPU, rows this rank sends per chunk and
            expert; candidate c owns rows [sum(candidates before c), + c).
        recv_counts_PCL: (e, sum(candidates), L) int64 CPU, rows received from each source
            rank per chunk and local expert.
    """

    candidates: tuple[int, ...]
    send_counts_CE: torch.Tensor
    recv_counts_PCL: torch.Tensor

    @property
    def recv_tokens(self) -> int:
        """s″: rows this rank's experts receive in this layer call (all chunks)."""
        c0 = self.candidates[0]
        return int(self.recv_counts_PCL[:, :c0].sum())

    def _rows(self, num_chunks: int) -> slice:
        if num_chunks not in self.candidates:
            raise ValueError(f"chunk count {num_chunks} was not exchanged; candidates "
                             f"{self.candidates}")
        start = sum(self.candidates[: self.candidates.index(num_chunks)])
        return slice(start, start + num_chunks)

    def send_counts(self, num_chunks: int) -> torch.Tensor:
        """(c, E) int64 rows sent per chunk and global expert."""
        return self.send_counts_CE[self._rows(num_chunks)]

    def recv_counts(self, num_chunks: int) -> torch.Tensor:
        """(e, c, L) int64 rows received per source rank, chunk and local expert."""
        return self.recv_counts_PCL[:, self._rows(num_chunks)]


def exchange_counts(top_k_index: torch.Tensor, num_experts: int, candidates: tuple[int, ...],
                    group: dist.ProcessGroup | None = None) -> ExpertCounts:
    """Notify: send every rank the counts of the rows it will receive, per chunk and expert.

    Args:
        top_k_index: (T, k) int64 global expert ids (sentinels allowed).
        num_experts: E, divisible by the group size.
        candidates: chunk counts to prepare (each ≥ 1, distinct).
        group: the EP group; every rank passes the same ``candidates`` (the payload size
            depends on them).

    Returns:
        :class:`ExpertCounts` (CPU tensors: split sizes are host-side ints).

    Side effects: one ``all_to_all_single`` of e·sum(candidates)·L int64 on ``group``.
    """
    P = dist.get_world_size(group)
    E = num_experts
    L = E // P
    counts_CE = torch.cat([chunk_expert_counts(top_k_index, E, c) for c in candidates])
    C = counts_CE.shape[0]
    dev = collective_device(group)
    send_PCL = counts_CE.view(C, P, L).permute(1, 0, 2).contiguous().to(dev)
    recv_PCL = torch.empty_like(send_PCL)
    dist.all_to_all_single(recv_PCL, send_PCL, group=group)
    return ExpertCounts(candidates=tuple(candidates), send_counts_CE=counts_CE.cpu(),
                        recv_counts_PCL=recv_PCL.cpu())


@dataclass(frozen=True, slots=True)
class ChunkDispatch:
    """Everything one chunk's dispatch and combine need; built once, reused by recompute.

    Attributes:
        start, stop: the chunk's token range [start, stop) of this rank's T tokens.
        send_index: :class:`RoutingIndex` of the chunk's tokens over the E global experts; rows
            grouped by expert are grouped by destination rank (experts are contiguous per rank).
        recv_index: :class:`RoutingIndex` over the S received rows (k = 1) and the L local
            experts; received rows are ordered (source rank, local expert, source token).
        send_splits: rows sent to each rank of the EP group (len e).
        recv_splits: rows received from each rank (len e).
    """

    start: int
    stop: int
    send_index: RoutingIndex
    recv_index: RoutingIndex
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]


def plan_chunks(top_k_index: torch.Tensor, counts: ExpertCounts, num_chunks: int,
                index_builder: str = "auto") -> list[ChunkDispatch]:
    """Build the frozen dispatch plan of every chunk from the exchanged counts.

    Args:
        top_k_index: (T, k) int64 global expert ids.
        counts: the notify result; ``num_chunks`` must be one of its candidates.
        num_chunks: the agreed chunk count c.
        index_builder: ``auto``, ``sort_free`` or ``argsort`` (see build_routing_index).

    Returns:
        c :class:`ChunkDispatch` in token order.

    Memory: int32 index arrays of all chunks, 4·(2·M + T·k + 2·S + ...) bytes, kept until
    backward (no activations).
    """
    send_CE, recv_PCL = counts.send_counts(num_chunks), counts.recv_counts(num_chunks)
    P, _, L = recv_PCL.shape
    E = send_CE.shape[1]
    dev = top_k_index.device
    local_ids_PL = torch.arange(L, device=dev).repeat(P)
    plans = []
    for i, (start, stop) in enumerate(chunk_bounds(top_k_index.shape[0], num_chunks)):
        send_index = build_routing_index(top_k_index[start:stop], E, index_builder)  # type: ignore[arg-type]
        recv_PL = recv_PCL[:, i]
        local_S1 = torch.repeat_interleave(local_ids_PL, recv_PL.reshape(-1).to(dev))[:, None]
        recv_index = build_routing_index(local_S1, L, index_builder)  # type: ignore[arg-type]
        plans.append(ChunkDispatch(
            start=start, stop=stop, send_index=send_index, recv_index=recv_index,
            send_splits=tuple(int(v) for v in send_CE[i].view(P, L).sum(1).tolist()),
            recv_splits=tuple(int(v) for v in recv_PL.sum(1).tolist())))
    return plans
