"""Expert weight gradients accumulated in place: across row blocks and across token chunks.

The fused backward (:class:`memfine.experts.function.FusedExpertsFunction`) streams over row
blocks and adds each block's per-expert products into one buffer per weight (``addmm_``), so no
block ever holds a weight-gradient-sized result of its own. Under token chunking (MemFine §4) the c
chunks share those buffers: :class:`SharedWeightGradsFunction` wraps the expert weights once, before
the chunk loop, hands the chunks aliases of them plus one :class:`WeightGradBuffers`, and in
backward returns the buffers as the weights' gradients. The autograd engine then never sums c
weight-gradient-sized tensors (which keeps two such buffers alive at once), and the gradients still
reach the parameters through their ``AccumulateGrad`` nodes, so ``.grad`` accumulation, tensor hooks
and post-accumulate-grad hooks (FSDP2's reduce-scatter) run as without chunking, once per layer
call. What is bypassed: hooks registered on the *aliases* see no per-chunk gradient (the chunks hand
theirs to the buffers), and a chunk Function that returns its own weight gradient (the plain path)
is summed into the buffer by the wrapper's backward.

Legend: E experts, I input features, O output features, S routed rows.
Reference: MoEBlaze §4.2 (weight gradients accumulated tile by tile); MemFine §4 (chunks);
docs/design.md §5.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from memfine.ops.grouped import grouped_weight_grad, grouped_weight_grad_supported


class WeightGradBuffers:
    """One gradient buffer per expert weight, filled in place block by block.

    A buffer is allocated uninitialised on first use; the first product written into an expert's
    slice overwrites it (``addmm_`` with beta = 0), later ones add to it, and the experts never
    written are zeroed when the buffer is handed over. So no pass zero-fills E·I·O elements that
    the first product overwrites anyway, and unused experts still get zeros, not ``None``.

    Memory: one buffer per weight, in the weight's own memory layout (``empty_like``); nothing
    else. A buffer that is never touched (no rows) is created at hand-over, zero-filled.
    """

    def __init__(self) -> None:
        """Create an empty set of buffers."""
        self._grads: dict[int, torch.Tensor] = {}
        self._unwritten: dict[int, list[bool]] = {}  # per slot: experts not written yet
        # (slot, expert) → fp32 (I, O) sum of a spanning bf16/fp16 expert's blocks so far
        self._acc: dict[tuple[int, int], torch.Tensor] = {}

    def _get(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        grad = self._grads.get(slot)
        if grad is None:
            # NOTE(memory): the only weight-gradient-sized allocation per weight and layer call.
            grad = self._grads[slot] = torch.empty_like(like)
            self._unwritten[slot] = [True] * like.shape[0]
        return grad

    def buffer(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer of weight ``slot`` (0: w_up, 1: w_down, ...), created like ``like``.

        Every expert not written yet is zeroed, so the result can be added into.
        """
        grad = self._get(slot, like)
        unwritten = self._unwritten[slot]
        for e, fresh in enumerate(unwritten):
            if fresh:
                grad[e].zero_()
                unwritten[e] = False
        return grad

    def accumulate_(self, slot: int, like: torch.Tensor, x_SI: torch.Tensor,
                    grad_y_SO: torch.Tensor, bounds: list[int] | None, row0: int,
                    block_offsets_E1: torch.Tensor | None = None, backend: str = "auto") -> None:
        """Add a row block's per-expert products into the buffer of ``slot``.

        As :func:`accumulate_grouped_weight_grad_`; the first product of an expert overwrites
        its uninitialised slice.
        """
        if bounds is None:
            accumulate_grouped_weight_grad_(self.buffer(slot, like), x_SI, grad_y_SO, None, row0,
                                            block_offsets_E1, backend)
            return
        if (block_offsets_E1 is not None
                and uses_grouped_weight_grads(x_SI, grad_y_SO, like.shape[0], backend)):
            grad_w_EIO = grouped_block_weight_grad(x_SI, grad_y_SO, block_offsets_E1, like)
            if slot not in self._grads:  # NOTE(memory): the first product is the buffer
                self._grads[slot] = grad_w_EIO
                self._unwritten[slot] = [False] * like.shape[0]
                return
            # NOTE(memory): a later block's product is a transient of the buffer's size
            self.buffer(slot, like).add_(grad_w_EIO)
            return
        accumulate_grouped_weight_grad_(self._get(slot, like), x_SI, grad_y_SO, bounds, row0,
                                        unwritten=self._unwritten[slot])

    def write_block_(self, slot: int, like: torch.Tensor, x_SI: torch.Tensor,
                     grad_y_SO: torch.Tensor, bounds: list[int] | None, row0: int,
                     block_offsets_E1: torch.Tensor | None = None, backend: str = "auto"
                     ) -> None:
        """A row block's weight gradients, written once into the experts' slices of ``slot``.

        Only the experts whose rows overlap the block [row0, row0 + B) are computed (``bounds``:
        the host expert_token_offsets). No host bounds (traced), fp32/float64 weights or a
        first block that holds all rows take :meth:`accumulate_`. Otherwise (bf16/fp16): a
        later chunk's single block adds per expert into the slices, and a first block of
        at least half the rows, in the grouped form, computes one ``_grouped_mm`` over all E
        experts that becomes the buffer (no copy; ``_grouped_mm`` has no ``out=``); every other
        block writes the experts it holds whole straight into their slices, one ``addmm_`` per
        expert (beta = 0 on first write; added under chunking, where a slice holds an earlier
        chunk's gradient), so no product is ever copied. An expert whose rows span blocks
        (at most the first and the last of a block) sums its pieces in an fp32 (I, O) tensor
        from its rows cast to fp32 (exact products) and is rounded into its slice once, in its
        last block.

        Args:
            slot: the weight (0: w_up, 1: w_down, 2: the up half).
            like: the (E, I, O) weight (any dense layout; the buffer takes it).
            x_SI: (B, I) block input rows.
            grad_y_SO: (B, O) block output-gradient rows.
            bounds: E + 1 host offsets of all rows, or None.
            row0: first grouped row of the block.
            block_offsets_E1: (E + 1,) int32 offsets of the block's rows (starting at 0).
            backend: grouped GEMM backend.

        Memory: the buffer (E·I·O, once per weight and layer call; no product transient); per
        spanning expert its fp32 (I, O) accumulator, live from its first block to its last,
        and its rows cast to fp32 (transient).
        Reference: MoEBlaze §4.2 (tiles accumulated in fp32, rounded once).
        """
        B = x_SI.shape[0]
        if (bounds is None or like.dtype not in LOW_PRECISION_DTYPES
                or (row0 == 0 and bounds[-1] <= B and slot not in self._grads)):
            self.accumulate_(slot, like, x_SI, grad_y_SO, bounds, row0, block_offsets_E1,
                             backend)
            return
        row1 = row0 + B
        e_lo = max(0, bisect.bisect_right(bounds, row0) - 1)
        e_hi = bisect.bisect_left(bounds, row1, hi=len(bounds) - 1)
        while e_lo < e_hi and bounds[e_lo + 1] <= row0:  # empty experts ending at row0
            e_lo += 1
        if e_lo >= e_hi:
            return
        spans = sorted({e for e in (e_lo, e_hi - 1) if bounds[e] < row0 or bounds[e + 1] > row1})
        i0 = e_lo + 1 if e_lo in spans else e_lo
        i1 = max(i0, e_hi - 1 if e_hi - 1 in spans else e_hi)
        E = like.shape[0]
        if (slot not in self._grads and row0 == 0 and bounds[-1] <= 2 * B
                and block_offsets_E1 is not None
                and uses_grouped_weight_grads(x_SI, grad_y_SO, E, backend)):
            # NOTE(memory): a first block of at least half the rows: its product over all E
            # experts is the buffer (its whole experts final, experts without rows exact
            # zeros); the rest is overwritten by later blocks
            self._grads[slot] = grouped_block_weight_grad(x_SI, grad_y_SO, block_offsets_E1, like)
            self._unwritten[slot] = [not (i0 <= e < i1 or bounds[e] == bounds[e + 1])
                                     for e in range(E)]
            i1 = i0
        grad = self._get(slot, like)
        if i0 < i1:  # whole experts: per-expert products straight into their slices
            lo, hi = bounds[i0] - row0, bounds[i1] - row0
            accumulate_grouped_weight_grad_(grad, x_SI[lo:hi], grad_y_SO[lo:hi], bounds,
                                            row0 + lo, unwritten=self._unwritten[slot])
        for e in spans:
            lo, hi = max(bounds[e], row0) - row0, min(bounds[e + 1], row1) - row0
            self._span_(slot, grad, e, x_SI[lo:hi], grad_y_SO[lo:hi], bounds[e + 1] <= row1)

    def _put(self, slot: int, grad: torch.Tensor, e0: int, e1: int,
             product: torch.Tensor) -> None:
        """Write ``product`` into experts [e0, e1) of ``grad`` (add where already written)."""
        unwritten = self._unwritten[slot]
        if all(unwritten[e0:e1]):
            grad[e0:e1].copy_(product)
        else:  # under chunking: an earlier chunk wrote some of these experts
            for e in range(e0, e1):
                if unwritten[e]:
                    grad[e].zero_()
            grad[e0:e1].add_(product)
        unwritten[e0:e1] = [False] * (e1 - e0)

    def _span_(self, slot: int, grad: torch.Tensor, e: int, x_RI: torch.Tensor,
               grad_y_RO: torch.Tensor, last: bool) -> None:
        """One block's rows of expert ``e`` (whose rows span blocks) into its fp32 sum.

        The rows are cast to fp32 (exact), their product added into the (I, O) fp32
        accumulator, which is rounded into the slice once, when ``last``.
        """
        acc = self._acc.pop((slot, e), None)
        # NOTE(memory): the rows in fp32 (transient), the (I, O) fp32 accumulator (kept)
        x_f, dy_f = x_RI.float(), grad_y_RO.float()
        acc = torch.mm(x_f.t(), dy_f) if acc is None else acc.addmm_(x_f.t(), dy_f)
        del x_f, dy_f
        if last:
            self._put(slot, grad, e, e + 1, acc[None])
        else:
            self._acc[(slot, e)] = acc

    def take(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """Hand over the buffer of ``slot`` (zeros where never written) and forget it."""
        grad = self.buffer(slot, like)
        del self._grads[slot], self._unwritten[slot]
        return grad


LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
"""Weight dtypes whose experts that span row blocks sum their blocks in fp32 (rounded once)."""


GROUPED_WEIGHT_GRAD_DTYPES = (torch.bfloat16,)
"""dtypes whose eager weight gradients are grouped GEMMs (:func:`uses_grouped_weight_grads`).

fp32 keeps the per-expert ``addmm_`` into the buffer: on the CPU (one thread) the grouped form
plus its per-block ``add_`` measured 1.5-3.5× slower with several row blocks (equal with one),
and on CUDA fp32 ``torch._grouped_mm`` takes its per-group fallback, which reads the offsets to
the host on every call."""


def uses_grouped_weight_grads(x_SI: torch.Tensor, grad_y_SO: torch.Tensor, num_experts: int,
                              backend: str = "auto") -> bool:
    """True when a row block's weight gradient is one grouped GEMM (else per-expert ``addmm_``).

    bf16 operands (:data:`GROUPED_WEIGHT_GRAD_DTYPES`) that
    :func:`memfine.ops.grouped.grouped_weight_grad_supported` accepts with E groups, unless the
    ``loop`` backend was chosen. The memory model follows the same rule
    (:func:`memfine.timeline.fused.grouped_weight_grads`).
    """
    return (backend != "loop" and x_SI.dtype in GROUPED_WEIGHT_GRAD_DTYPES
            and grouped_weight_grad_supported(x_SI, grad_y_SO, num_experts))


def grouped_block_weight_grad(x_SI: torch.Tensor, grad_y_SO: torch.Tensor,
                              block_offsets_E1: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """dW[e] = X[rows of e]ᵀ · dY[rows of e] for one row block, as one ``torch._grouped_mm``.

    Layout: A = Xᵀ (I, B), a column-major view of the row-major block rows, B = dY (B, O)
    row-major, offsets along K (the block's rows): the 2-D × 2-D form whose CUDA kernel accepts
    empty groups (experts with no rows in the block get exact zeros). When ``like`` is a
    transposed view of an (E, O, I) tensor, dWᵀ = dYᵀ·X is computed as (E, O, I) with A = dYᵀ
    and B = X, and returned transposed (the buffer keeps the weight's own layout).

    Args:
        x_SI: (B, I) block input rows, row-major.
        grad_y_SO: (B, O) block output-gradient rows, row-major.
        block_offsets_E1: (E + 1,) int32 offsets of the block's rows (starting at 0).
        like: the (E, I, O) weight.

    Returns:
        (E, I, O) new tensor in ``like``'s memory layout.

    Memory: the result, E·I·O elements; nothing else.
    """
    ends_E = block_offsets_E1[1:]
    if like.dim() == 3 and like.stride(1) == 1 and like.stride(2) != 1:
        return torch._grouped_mm(grad_y_SO.t(), x_SI, offs=ends_E).transpose(1, 2)
    return torch._grouped_mm(x_SI.t(), grad_y_SO, offs=ends_E)


def accumulate_grouped_weight_grad_(grad_w_EIO: torch.Tensor, x_SI: torch.Tensor,
                                    grad_y_SO: torch.Tensor, bounds: list[int] | None, row0: int,
                                    block_offsets_E1: torch.Tensor | None = None,
                                    backend: str = "auto", *,
                                    unwritten: list[bool] | None = None) -> None:
    """grad_w[e] += X[rows of e]ᵀ · dY[rows of e] for the experts present in a row block.

    Args:
        grad_w_EIO: (E, I, O) buffer, written in place (any dense layout, e.g. a transposed view).
        x_SI: (B, I) input rows of the block (rows ``row0 .. row0 + B`` of the grouped order).
        grad_y_SO: (B, O) output-gradient rows of the block.
        bounds: the E + 1 expert_token_offsets as Python ints (host copy, read once per backward),
            or None under ``torch.compile``, where host values are unknown while tracing: the
            block's gradient is then one grouped GEMM over ``block_offsets_E1`` added into the
            buffer (a transient of the buffer's size).
        row0: first grouped row of the block.
        block_offsets_E1: (E + 1,) int32 offsets of the block's rows (used when ``bounds`` is None).
        backend: grouped GEMM backend for that case.
        unwritten: optional per-expert flags, True where ``grad_w[e]`` holds no value yet: the
            product then overwrites it (beta = 0, its old contents never read) and the flag is
            cleared. None: every expert is added into.

    Memory: none (``addmm_`` writes into the buffer; BLAS reads transposed operands in place).
    """
    if bounds is None:
        assert block_offsets_E1 is not None, "the traceable path needs the block's offsets"
        grad_w_EIO.add_(grouped_weight_grad(x_SI, grad_y_SO, block_offsets_E1,
                                            grad_w_EIO.shape[0], backend, like=grad_w_EIO))
        return
    row1 = row0 + x_SI.shape[0]
    # only the experts whose rows overlap [row0, row1) (bounds are non-decreasing)
    for e in range(max(0, bisect.bisect_right(bounds, row0) - 1),
                   bisect.bisect_left(bounds, row1, hi=len(bounds) - 1)):
        lo, hi = max(bounds[e], row0), min(bounds[e + 1], row1)
        if hi > lo:
            beta = 1
            if unwritten is not None and unwritten[e]:
                beta, unwritten[e] = 0, False
            grad_w_EIO[e].addmm_(x_SI[lo - row0:hi - row0].t(), grad_y_SO[lo - row0:hi - row0],
                                 beta=beta)


class SharedWeightGradsFunction(torch.autograd.Function):
    """Identity on the expert weights whose backward returns the chunks' shared buffers.

    forward(buffers, *weights) → aliases (views) of the weights. The chunks compute with the
    aliases and add their weight gradients into ``buffers`` (slot i for weight i); backward returns
    ``buffers.take(i)`` for weight i, plus any gradient a chunk returned through autograd.

    Saved for backward: the weights (parameters: no activation bytes); the buffers object is a
    Python attribute of ctx.
    Reference: MemFine §4 (chunked backward); MoEBlaze §4.2.
    """

    @staticmethod
    def forward(ctx: Any, buffers: WeightGradBuffers, *weights: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        """Return views of ``weights`` (no copy); remember ``buffers`` for backward."""
        ctx.buffers = buffers
        ctx.save_for_backward(*weights)  # NOTE(memory): the weights themselves (no activation)
        ctx.set_materialize_grads(False)  # NOTE(memory): no zero-filled placeholder gradients
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        """The accumulated buffers (zeros where no chunk had rows) as the weights' gradients."""
        out: list[torch.Tensor | None] = [None]  # None: buffers
        needs = ctx.needs_input_grad[1:]
        for slot, (grad, needed, weight) in enumerate(zip(grads, needs, ctx.saved_tensors,
                                                          strict=True)):
            if not needed:
                out.append(None)
                continue
            total = ctx.buffers.take(slot, weight)
            out.append(total if grad is None else total.add_(grad))
        return tuple(out)


def share_weight_grads(weights: tuple[torch.Tensor, ...]
                       ) -> tuple[tuple[torch.Tensor, ...], WeightGradBuffers | None]:
    """Aliases of ``weights`` whose chunks accumulate into one set of buffers.

    Args:
        weights: the expert weights (w_up, w_down, optional biases) in slot order.

    Returns:
        ``(aliases, buffers)``; when autograd is off or no weight requires a gradient, the
        weights themselves and ``None`` (nothing to accumulate).
    """
    if not torch.is_grad_enabled() or not any(w.requires_grad for w in weights):
        return weights, None
    buffers = WeightGradBuffers()
    return SharedWeightGradsFunction.apply(buffers, *weights), buffers
