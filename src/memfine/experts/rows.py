"""Row blocks of the fused experts: their bookkeeping and the streamed forward.

The fused Function (:class:`memfine.experts.function.FusedExpertsFunction`) walks the S
expert-grouped rows in blocks [r0, r1) of ``block_rows`` rows, in forward and in backward
(MoEBlaze §4.2: row tiles; a plain row tile may cut an expert). :class:`RowBlocks` holds what
every block needs, computed once per pass: the bounds, each row's routing weight and every block's
grouped offsets. :func:`forward_rows` is the streamed forward: per block it gathers the block's x
rows, keeps its H rows and adds its weighted outputs into the (T, d) result, so no (S, d)
gathered copy, no (S, n) A, no (S, d) Y and no (T, k, d) scattered copy ever exists.

Legend: T tokens, K top-k slots, S routed rows, B rows of a block, E experts, D = d, N = n,
G = 2n (gated) or n.
Reference: MoEBlaze (arXiv 2601.05296) §4 (buffer-free dispatch, per-token reduction),
§4.2 (row tiles); docs/design.md §5.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memfine.activations import Activation, apply_activation
from memfine.ops.grouped import grouped_mm
from memfine.ops.up_projection import up_project

if TYPE_CHECKING:
    from memfine.lora.adapters import LoRAForward


def expert_of_rows(offsets_E1: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(S,) int64 expert id of every expert-grouped row, from expert_token_offsets (E + 1,)."""
    E = offsets_E1.shape[0] - 1
    counts_E = (offsets_E1[1:] - offsets_E1[:-1]).long()
    return torch.repeat_interleave(torch.arange(E, device=offsets_E1.device), counts_E,
                                   output_size=num_rows)


def add_row_bias_(rows_SO: torch.Tensor, bias_EO: torch.Tensor | None,
                  offsets_E1: torch.Tensor) -> torch.Tensor:
    """rows[r] += bias[expert of r] in place (no-op without a bias); returns rows."""
    if bias_EO is None:
        return rows_SO
    expert_S = expert_of_rows(offsets_E1, rows_SO.shape[0])
    # NOTE(memory): the (S, O) gathered bias is transient; only the parameter is saved.
    return rows_SO.add_(bias_EO.index_select(0, expert_S))


def row_blocks(S: Any, max_rows: int, block_rows: int, traced: bool, stream_traced: bool
               ) -> list[tuple[Any, Any]]:
    """The [r0, r1) row blocks of the streamed forward and backward.

    Eager: blocks of ``block_rows`` over the S rows. Under torch.compile S is an unbacked size:
    one block [0, S) unless ``stream_traced``; then the blocks tile the static bound S ≤ T·k
    (``max_rows``) and each end is min(S, r0 + B), so blocks past S are empty and the block
    count is fixed by T and k, not by the routing.
    """
    if not traced:
        return [(r0, min(S, r0 + block_rows)) for r0 in range(0, S, block_rows)]
    if not stream_traced:
        return [(0, S)]
    blocks = []
    for r0 in range(0, max(1, max_rows), block_rows):
        r1 = torch.sym_min(S, r0 + block_rows)
        torch._check(r1 >= 0)
        blocks.append((torch.sym_min(r0, r1), r1))
    return blocks


@dataclass(slots=True)
class RowBlocks:
    """The row blocks of one fused pass and their bookkeeping, built once per pass.

    Attributes:
        bounds: the [r0, r1) blocks (:func:`row_blocks`).
        offsets_E1: (E + 1,) int32 expert_token_offsets of all S rows.
        w_S: (S,) routing weight of every row, weights[expert_slot_indices], x's dtype.
        block_offsets: eagerly with several blocks, every block's grouped offsets at once,
            (n_blocks, E + 1) int32 clamp(offsets − r0, 0, block_rows); else None.
        eager: the bounds are ints (not traced by torch.compile).
        host: the E + 1 expert_token_offsets as host ints when each block's GEMMs take only
            the experts whose rows it holds (:meth:`experts_of`), else None (all E).
    """

    bounds: list[tuple[Any, Any]]
    offsets_E1: torch.Tensor
    w_S: torch.Tensor
    block_offsets: torch.Tensor | None
    eager: bool
    host: list[int] | None = None

    @classmethod
    def plan(cls, bounds: list[tuple[Any, Any]], block_rows: int, offsets_E1: torch.Tensor,
             weights_TK: torch.Tensor, slot_S: torch.Tensor, eager: bool,
             host: list[int] | None = None) -> RowBlocks:
        """The bookkeeping of ``bounds`` (no host read; ``host``: see the attribute).

        One ``index_select`` and, with several blocks, an arange, a subtraction and a clamp.

        Memory: w_S (S·D_t bytes) and, with several blocks, the (n_blocks, E + 1) int32
        offsets, held for the pass; the block starts (n_blocks int32) are transient.
        """
        # NOTE(memory): S·D_t bytes for the whole pass (not B·(D_t + 8) per block)
        w_S = weights_TK.reshape(-1).index_select(0, slot_S)
        if not eager or len(bounds) < 2:
            return cls(bounds, offsets_E1, w_S, None, eager)
        starts_n1 = torch.arange(0, bounds[-1][0] + 1, block_rows, dtype=offsets_E1.dtype,
                                 device=offsets_E1.device)[:, None]
        # NOTE(memory): (n_blocks, E + 1) int32 offsets, freed with the pass
        block_offsets = (offsets_E1[None, :] - starts_n1).clamp_(0, block_rows)
        return cls(bounds, offsets_E1, w_S, block_offsets, eager, host)

    def experts_of(self, b: int, r0: Any, r1: Any, num_rows: Any
                   ) -> tuple[torch.Tensor, slice]:
        """Block ``b``'s grouped offsets and the slice of experts its GEMMs take.

        With several eager blocks and host offsets: the experts e0 ≤ e < e1 whose rows overlap
        [r0, r1) (offsets ``block_offsets[b, e0:e1 + 1]``, starting at 0 and ending at B), so
        a block's grouped GEMMs read only those experts' weights; else all E experts.
        """
        offs = self.offsets_of(b, r0, r1, num_rows)
        if self.host is None or self.block_offsets is None:
            return offs, slice(None)
        e0 = bisect.bisect_right(self.host, r0) - 1  # the expert holding row r0
        e1 = bisect.bisect_left(self.host, r1, lo=e0 + 1)  # the first starting at or after r1
        return offs[e0:e1 + 1], slice(e0, e1)

    def offsets_of(self, b: int, r0: Any, r1: Any, num_rows: Any) -> torch.Tensor:
        """(E + 1,) int32 grouped offsets of block ``b`` = rows [r0, r1), starting at 0."""
        if self.block_offsets is not None:
            return self.block_offsets[b]
        if self.eager and r0 == 0 and r1 == num_rows:
            return self.offsets_E1  # one eager block: the offsets as they are
        return self.offsets_E1.clamp(r0, r1) - r0


def block_tokens(token_idx_S: torch.Tensor, r0: Any, r1: Any, by_sort: bool) -> torch.Tensor:
    """The tokens of rows [r0, r1): int64 on the CPU's path, the int32 slice on a device's.

    The CPU's ``index_select`` and ``index_add_`` run faster on int64 indices than on int32
    ones (one thread, a (B, d) block); a device's path (``by_sort``, the sorted per-token sum
    of :func:`add_token_rows_`) takes the slice as it is (no extra kernel), also where the
    counts suite runs that path on the CPU.
    Memory: on the CPU's path, B int64 (B·8 bytes) for the block.
    """
    token_B = token_idx_S[r0:r1]
    return token_B if by_sort else token_B.long()


def add_token_rows_(out_TD: torch.Tensor, rows_BD: torch.Tensor, token_B: torch.Tensor,
                    by_sort: bool) -> None:
    """out[t] += Σ over the block's rows r of token t of rows[r], deterministically.

    Without ``by_sort`` (the CPU): ``index_add_`` over the rows' tokens, a sequential sum in
    row order (the fastest form there). With it (every other device, whose ``index_add_`` adds
    duplicates with atomics in a varying order): ``index_put_(accumulate=True)`` over the same
    tokens, whose CUDA kernel sorts the indices (stable) and sums each token's rows in row
    order, no atomics, so two runs give the same bits with or without
    ``torch.use_deterministic_algorithms(True)``. Chosen by the counts over a per-token gather
    (``embedding_bag`` through token_index_map, which reads all T tokens and writes a (T, d)
    block sum per block; docs/design.md §5).

    Memory: none beyond the sort's index workspace (B int64 on CUDA; never a tensor here).
    Reference: MoEBlaze §4 (per-token reduction, no atomics).
    """
    if not by_sort:
        out_TD.index_add_(0, token_B, rows_BD)
        return
    out_TD.index_put_((token_B,), rows_BD, accumulate=True)


def forward_rows(x_TD: torch.Tensor, blocks: RowBlocks, up_parts: tuple[torch.Tensor, ...],
                 w_down_END: torch.Tensor, b_up_EG: torch.Tensor | None,
                 b_down_ED: torch.Tensor | None, token_idx_S: torch.Tensor,
                 activation: Activation, backend: str, *,
                 by_sort: bool, lora: LoRAForward | None = None
                 ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(H per block, out) of the grouped GEMM backends, streamed over ``blocks``.

    Per block of B rows: x rows gathered (:func:`block_tokens`), H rows = x·[up_parts]
    (+ bias) kept as the block's own tensor (the up-projection's result, never copied),
    A = act(H rows), Y = A·w_down (+ bias), Y ⊙ w added into out per token
    (:func:`add_token_rows_`). ``lora``: split adapters (:mod:`memfine.lora.adapters`),
    streamed with the blocks.

    Args:
        x_TD: (T, d) layer input.
        blocks: the pass's :class:`RowBlocks`.
        up_parts: the up-projection as one (E, d, G) tensor or its (gate, up) halves.
        w_down_END: (E, n, d) down-projection.
        b_up_EG: optional (E, G) up-projection bias.
        b_down_ED: optional (E, d) down-projection bias.
        token_idx_S: (S,) int32 expert_token_indices.
        activation: the experts' activation.
        backend: grouped GEMM backend.
        by_sort: sum the rows per token with the sorted ``index_put_`` (:func:`add_token_rows_`).
        lora: split-LoRA forward terms, or None.

    Returns:
        Every block's H rows, (B, G) each in block order (one (0, G) tensor when S = 0; their
        concatenation is H (S, G)), and out (T, d), in x's dtype.

    Memory: out (T·d, zero-filled first) and each block's H rows (B·G, kept: S·G in all);
    per block, transients x rows (B·d), A (B·n, plus the activation's own temporaries),
    Y (B·d), w ⊙ Y (B·d) and, on the CPU, the block's int64 tokens (B·8 bytes).
    """
    S, (T, D) = token_idx_S.shape[0], x_TD.shape
    out_TD = x_TD.new_zeros(T, D)
    h_blocks: list[torch.Tensor] = []  # NOTE(memory): B·G per block, S·G in all, no copy
    for b, (r0, r1) in enumerate(blocks.bounds):
        offs_E1, held = blocks.experts_of(b, r0, r1, S)
        token_B = block_tokens(token_idx_S, r0, r1, by_sort)
        x_BD = x_TD.index_select(0, token_B)  # NOTE(memory): B·d, never saved
        h_BG = add_row_bias_(up_project(x_BD, tuple(p[held] for p in up_parts), offs_E1,
                                        backend), b_up_EG, offs_E1)
        # the adapters take all E experts' offsets (offs_E1 may be the block's experts only)
        lora_offs = offs_E1 if lora is None else blocks.offsets_of(b, r0, r1, S)
        if lora is not None:  # split LoRA: H += s·(x·Aᵀ)·Bᵀ
            lora.up_(h_BG, x_BD, lora_offs, r0, S)
        del x_BD
        h_blocks.append(h_BG)
        a_BN = apply_activation(h_BG, activation)
        y_BD = grouped_mm(a_BN, w_down_END[held], offs_E1, backend)
        if lora is not None:
            lora.down_(y_BD, a_BN, lora_offs, r0, S)
        del a_BN  # NOTE(memory): A is recomputed from H in backward
        # w ⊙ Y out of place: Y is a GEMM output, which selective activation checkpointing may
        # have cached (a cached tensor must not be mutated)
        weighted_BD = add_row_bias_(y_BD, b_down_ED, offs_E1) * blocks.w_S[r0:r1, None]
        del y_BD  # NOTE(memory): Y is never saved
        add_token_rows_(out_TD, weighted_BD, token_B, by_sort)
        del weighted_BD, token_B
    if not h_blocks:  # no block (S == 0)
        h_blocks.append(x_TD.new_empty(0, sum(p.shape[2] for p in up_parts)))
    return tuple(h_blocks), out_TD
