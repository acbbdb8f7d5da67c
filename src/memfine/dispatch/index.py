"""The MoEBlaze routing index: four int32 arrays that replace the permuted T·k × d activation copy.

Legend: T tokens, E experts, K top-k slots, M = T·k (token, slot) pairs, S routed rows (valid
(token, slot) pairs, ≤ T·k).
Sentinel ids (outside [0, E): padding, expert-parallel remote experts, dropped pairs) are never
dispatched: they get no row and ``token_index_map`` holds -1 for them.
Both builders are ``torch.compile``-friendly: every tensor has a shape fixed by T, k and E except
the (S,) arrays, whose length S is read once from the offsets. In eager that is the forward's one
host read (the E + 1 offsets, with the sort-free builder's repeat flag, in one ``.tolist()``; the
offsets are kept on the index as ``host_offsets`` for the backward's block bookkeeping); under
``torch.compile`` S is an unbacked size with the bounds 0 ≤ S ≤ T·k, so a new S never
recompiles and the graph does not break: with ``torch._dynamo.config.capture_scalar_outputs`` the
``.item()`` itself is traced, without it the (S,) slice is the custom op ``memfine::routed_slots``,
whose fake implementation makes the same unbacked size (:func:`routed_slots`). The sort-free
builder's duplicate check raises in eager and becomes an asynchronous assert under compile
(:func:`memfine._checks.check_tensor`).
Reference: MoEBlaze (arXiv 2601.05296) §3-§4; docs/design.md §3 (worked example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from memfine._checks import check_tensor
from memfine.routing.precision import count_per_expert

SORT_FREE_MAX_CELLS = 1 << 22
"""``auto`` off the CPU: sort-free while the dense T×E map has at most this many cells.

The sort-free builder's dense map costs T·E·8 bytes (int64 scan); above this the argsort builder,
whose workspace is O(T·k), is used."""

CPU_SORT_FREE_MAX_CELLS = 1 << 15
"""``auto`` on the CPU: sort-free up to 32,768 dense-map cells, argsort above.

In the last run of ``benchmarks/bench_index.py`` (one thread, thread CPU time, interleaved,
medians of per-round ratios; ``benchmarks/results/bench_index_cpu.csv``) argsort took 0.55-0.68×
the sort-free builder's time from 65,536 to 1,048,576 cells and 0.03-0.09× from 2M cells up,
while at 32,768 cells it took 1.15× (sort-free the faster); at 8,192 cells 0.86×, within the
rounds' spread (p20-p80)."""


def sort_free_max_cells(device_type: str) -> int:
    """The most dense-map cells (T·E) ``auto`` builds sort-free on ``device_type``.

    :data:`CPU_SORT_FREE_MAX_CELLS` on the CPU (measured there), :data:`SORT_FREE_MAX_CELLS`
    elsewhere. The memory model applies the same rule (:mod:`memfine.timeline.experts`).
    """
    return CPU_SORT_FREE_MAX_CELLS if device_type == "cpu" else SORT_FREE_MAX_CELLS


@dataclass(frozen=True, slots=True)
class RoutingIndex:
    """The four MoEBlaze index arrays (plus the per-row slot id) for one routing decision.

    Attributes:
        expert_token_indices: (S,) int32 token id of each routed row, rows grouped by expert,
            ascending token id within an expert.
        expert_token_offsets: (E + 1,) int32 exclusive prefix sum of per-expert row counts; expert
            e owns rows [off[e], off[e+1]); off[0] = 0, off[E] = S.
        token_expert_indices: (T, k) int32 the experts of each token in token order (sentinels
            kept).
        token_index_map: (T, k) int32 row of slot (t, j) in the expert-grouped order, -1 for a
            sentinel slot.
        expert_slot_indices: (S,) int32 flat slot id t·k + j of each row (used to read the row's
            routing weight); ``expert_token_indices == expert_slot_indices // k``.
        num_experts: E.
        host_offsets: the E + 1 offsets as Python ints, read in the builder's one host read
            (eager), or None (under ``torch.compile``, or for an index built elsewhere).
    """

    expert_token_indices: torch.Tensor
    expert_token_offsets: torch.Tensor
    token_expert_indices: torch.Tensor
    token_index_map: torch.Tensor
    expert_slot_indices: torch.Tensor
    num_experts: int
    host_offsets: tuple[int, ...] | None = None

    # The sizes are returned as the shapes hold them (not through int()): under torch.compile
    # S is a symbolic size, and int() would force a concrete value.
    @property
    def num_tokens(self) -> int:
        """T."""
        return self.token_index_map.shape[0]

    @property
    def top_k(self) -> int:
        """The number k of top-k slots per token."""
        return self.token_index_map.shape[1]

    @property
    def num_rows(self) -> int:
        """S, routed rows (valid (token, slot) pairs)."""
        return self.expert_token_indices.shape[0]

    def tokens_per_expert(self) -> torch.Tensor:
        """(E,) int32 rows per expert (differences of the offsets)."""
        return self.expert_token_offsets.diff()


def _check_top_k_index(top_k_index: torch.Tensor, num_experts: int) -> None:
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be (T, k), got shape {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"top_k_index must be int64 or int32, got {top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")


def routed_slots(slot_order_M: torch.Tensor, expert_token_offsets: torch.Tensor,
                 host_offsets: list[int] | None = None) -> torch.Tensor:
    """The routed head of an expert-grouped slot order: ``slot_order_M[:S]``, S = offsets[E].

    S is data-dependent (the valid (token, slot) pairs), so it is where a compiled expert path
    would break its graph. In eager it is read from ``host_offsets`` (the builder's one host
    read) or with one ``.item()``, and the result is a view. While ``torch.compile`` traces it
    stays in the graph either way: with Dynamo's ``capture_scalar_outputs`` the ``.item()``
    becomes an unbacked size; without it (the default) the slice runs as the custom op
    ``memfine::routed_slots`` (a copy of S int64, 8·S bytes), whose fake implementation returns
    an unbacked size. Both carry the bounds 0 ≤ S ≤ T·k, so a new S reuses the graph.

    Args:
        slot_order_M: (T·k,) int64 flat slot ids t·k + j in expert-grouped order, the S routed
            slots first, sentinel slots after them.
        expert_token_offsets: (E + 1,) int64 exclusive prefix sum of the per-expert counts;
            its last entry is S.
        host_offsets: the same offsets already read to the host (eager only), or None.

    Returns:
        (S,) int64: ``slot_order_M[:S]`` (a view in eager and with ``capture_scalar_outputs``,
        a new tensor from the custom op otherwise).

    Reference: MoEBlaze §3 (the routed rows of the index arrays); docs/compile.md (graph breaks).
    """
    if torch.compiler.is_compiling() and not _captures_scalar_outputs():
        return torch.ops.memfine.routed_slots(slot_order_M, expert_token_offsets)
    S = (host_offsets[-1] if host_offsets is not None
         else int(expert_token_offsets[-1].item()))
    torch._check(S >= 0)
    torch._check(slot_order_M.shape[0] >= S)
    return slot_order_M[:S]


def read_offsets(offsets_E1: torch.Tensor, *flags: torch.Tensor) -> list[int] | None:
    """The forward's one host read: the E + 1 offsets and any 0-dim integer ``flags`` after them.

    Returns:
        ``offsets + flags`` as Python ints (one ``.tolist()``: one device sync on CUDA), or None
        while ``torch.compile`` traces (host values are unknown then).
    """
    if torch.compiler.is_compiling():
        return None
    if not flags:
        return list(offsets_E1.tolist())
    # NOTE(memory): a transient (E + 1 + len(flags)) int64 copy, so the read is one sync
    return list(torch.cat([offsets_E1.long(), *(f.long().view(1) for f in flags)]).tolist())


def _captures_scalar_outputs() -> bool:
    """Dynamo's ``capture_scalar_outputs`` (read while tracing only: Dynamo is loaded then)."""
    import torch._dynamo

    return bool(torch._dynamo.config.capture_scalar_outputs)


@torch.library.custom_op("memfine::routed_slots", mutates_args=())
def _routed_slots_op(slot_order_M: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    S = int(offsets_E1[-1].item())
    if not 0 <= S <= slot_order_M.shape[0]:  # the fake impl's bounds; a violation is a bug
        raise RuntimeError(f"routed_slots: S={S} outside [0, T·k={slot_order_M.shape[0]}]")
    return slot_order_M[:S].clone()  # a custom op may not return a view of its input


@_routed_slots_op.register_fake
def _(slot_order_M: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    M = slot_order_M.shape[0]  # T·k: an int, or a symbolic size under dynamic shapes
    S = torch.library.get_ctx().new_dynamic_size(min=0, max=M if isinstance(M, int) else None)
    torch._check(S <= M)
    return slot_order_M.new_empty(S)


def build_index_argsort(top_k_index: torch.Tensor, num_experts: int) -> RoutingIndex:
    """Build the routing index with one stable argsort over the T·k slots.

    Args:
        top_k_index: (T, k) int64/int32 expert ids, any strides; ids outside [0, E) are
            sentinels.
        num_experts: E.

    Returns:
        The :class:`RoutingIndex`. Workspace O(T·k) int64. One host read (the offsets).

    Raises:
        ValueError: on a wrong shape or dtype.

    Reference: the counting-sort fallback of MoEBlaze §3; torchtitan's argsort dispatch.
    """
    _check_top_k_index(top_k_index, num_experts)
    T, k = top_k_index.shape
    E = num_experts
    flat_M = top_k_index.reshape(-1).long()
    valid_M = (flat_M >= 0) & (flat_M < E)
    key_M = torch.where(valid_M, flat_M, E)
    order_M = torch.argsort(key_M, stable=True)
    counts_E = count_per_expert(key_M, E)
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=flat_M.device)
    offsets[1:] = counts_E.cumsum(0)
    row_of_slot_M = torch.empty_like(order_M)
    row_of_slot_M[order_M] = torch.arange(T * k, device=flat_M.device)
    row_of_slot_M = torch.where(valid_M, row_of_slot_M, -1)
    host = read_offsets(offsets)
    slots_S = routed_slots(order_M, offsets, host)
    return _index(top_k_index, slots_S, offsets, row_of_slot_M.view(T, k), E, host)


def _index(top_k_index: torch.Tensor, slots_S: torch.Tensor, offsets_E1: torch.Tensor,
           row_TK: torch.Tensor, num_experts: int, host: list[int] | None) -> RoutingIndex:
    """The :class:`RoutingIndex` from the routed slots, the offsets and the row of every slot."""
    k = top_k_index.shape[1]
    return RoutingIndex(
        expert_token_indices=(slots_S // k).int(),
        expert_token_offsets=offsets_E1.int(),
        token_expert_indices=top_k_index.int().contiguous(),
        token_index_map=row_TK.int(),
        expert_slot_indices=slots_S.int(),
        num_experts=num_experts,
        host_offsets=None if host is None else tuple(host),
    )


_REPEAT_MESSAGE = "top_k_index must hold distinct experts within each token"


def build_index_sort_free(top_k_index: torch.Tensor, num_experts: int) -> RoutingIndex:
    """Build the routing index without sorting, from a dense T×E token map.

    Steps (MoEBlaze §3): (1) dense map, cell (t, e) set when token t chose e (no collisions: a
    token's k experts are distinct); (2) per-expert counts and their exclusive prefix sum give the
    offsets; (3) a per-expert inclusive scan over tokens gives each set cell its row.

    Args:
        top_k_index: (T, k) int64/int32 expert ids, any strides, distinct within a token; ids
            outside [0, E) are sentinels.
        num_experts: E.

    Returns:
        The :class:`RoutingIndex`, identical to :func:`build_index_argsort`. Workspace
        O(T·E) int64 (the dense map and its scan) plus O(T·k) int64. One host read (the
        offsets and the repeat flag together).

    Raises:
        ValueError: on a wrong shape or dtype, or an expert id repeated within a token.

    Reference: MoEBlaze §3 (sort-free index construction).
    """
    index = _build_sort_free(top_k_index, num_experts)
    if index is None:
        raise ValueError(_REPEAT_MESSAGE)
    return index


def _build_sort_free(top_k_index: torch.Tensor, num_experts: int) -> RoutingIndex | None:
    """:func:`build_index_sort_free`, or None (eager) when a token repeats an expert."""
    _check_top_k_index(top_k_index, num_experts)
    T, k = top_k_index.shape
    E = num_experts
    dev = top_k_index.device
    idx_TK = top_k_index.long().contiguous()  # any strides in; every view below is dense
    valid_TK = (idx_TK >= 0) & (idx_TK < E)
    safe_TK = torch.where(valid_TK, idx_TK, E)  # sentinels land in a spare column E
    dense_TE = torch.zeros(T, E + 1, dtype=torch.int64, device=dev)
    dense_TE.scatter_add_(1, safe_TK, torch.ones_like(safe_TK))
    dense_TE = dense_TE[:, :E]
    counts_E = dense_TE.sum(0)
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = counts_E.cumsum(0)
    if torch.compiler.is_compiling():
        host = None
        if T:
            check_tensor(dense_TE.max() <= 1, _REPEAT_MESSAGE)
    else:  # the one host read: the offsets and the largest cell (a repeat when > 1)
        host = read_offsets(offsets, *((dense_TE.max(),) if T else ()))
        assert host is not None, "eager reads the offsets"
        if T and host.pop() > 1:  # host: the E + 1 offsets after the pop
            return None
    row_TE = dense_TE.cumsum(0) - 1 + offsets[:E]  # row of cell (t, e) when it is set
    row_TK = torch.where(valid_TK, row_TE.gather(1, safe_TK.clamp(max=E - 1)), -1)
    # Sentinel slots take the rows S, S+1, ... in slot order, so perm_M is a permutation of
    # [0, T·k) and one scatter (no duplicate index, no boolean indexing) inverts it.
    sentinel_M = (~valid_TK).view(-1)
    perm_M = torch.where(sentinel_M, sentinel_M.cumsum(0).add_(offsets[E] - 1), row_TK.view(-1))
    slot_M = torch.arange(T * k, device=dev)
    expert_slot = torch.empty_like(slot_M).scatter_(0, perm_M, slot_M)
    expert_slot = routed_slots(expert_slot, offsets, host)
    return _index(top_k_index, expert_slot, offsets, row_TK, E, host)


def build_routing_index(top_k_index: torch.Tensor, num_experts: int,
                        builder: Literal["auto", "sort_free", "argsort"] = "auto") -> RoutingIndex:
    """Build the routing index with the chosen builder.

    Args:
        top_k_index: (T, k) int64/int32 expert ids, any strides (transposed, sliced or expanded
            views are read as their values; sentinels outside [0, E) allowed). A token may
            repeat an expert (e.g. DeepSeek-V4's hash routing): each slot then gets its own
            row, as a per-token loop computes it; only the sort-free builder refuses that.
        num_experts: E.
        builder: ``sort_free``, ``argsort``, or ``auto`` (sort-free while T·E ≤
            :func:`sort_free_max_cells` of the index's device, else argsort; in eager a
            repeated expert, seen in the sort-free builder's one host read, switches to
            argsort). Under ``torch.compile``
            ``auto`` picks by size alone, and a repeated expert then fails the sort-free
            builder's asynchronous assert (pass ``argsort`` for routers that repeat experts).

    Returns:
        The :class:`RoutingIndex`.

    Raises:
        ValueError: on an unknown builder, or from the builders.

    Host syncs: one in eager (the offsets, read once; two when ``auto`` meets a repeat).
    """
    if builder == "auto":
        _check_top_k_index(top_k_index, num_experts)
        if top_k_index.shape[0] * num_experts <= sort_free_max_cells(top_k_index.device.type):
            index = _build_sort_free(top_k_index, num_experts)
            if index is not None:
                return index
        builder = "argsort"
    if builder == "sort_free":
        return build_index_sort_free(top_k_index, num_experts)
    if builder == "argsort":
        return build_index_argsort(top_k_index, num_experts)
    raise ValueError(f"builder must be 'auto', 'sort_free' or 'argsort', got {builder!r}")
