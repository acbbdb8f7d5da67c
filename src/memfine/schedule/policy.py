"""Runtime chunk policy: a fixed chunk count, or MACT's budget-driven choice per step and layer.

With ``ChunkConfig.memory_budget_bytes`` set, every call of an MoE layer reads the rows its
experts receive this step (s″) and picks the smallest chunk count c of the configured bins whose
*exact* predicted peak fits the budget (MemFine §4.2, MACT; Eq. 8-9 read with our own memory
model). The prediction is the allocation timeline of the layer's forward + backward
(:func:`memfine.memory.layer.layer_peak_bytes`, which the tests hold equal to
``torch.profiler``), one replay per (T, D_t, recompute, c), cached: a training step with a
constant T replays the timeline once per bin and then looks the peaks up. Without a budget,
c = ``ChunkConfig.num_chunks``.

Expert parallelism (``chunk_rows``, a :class:`ChunkRows` from the count exchange): the
prediction is the expert-parallel layer's own timeline
(:func:`memfine.memory.layer.ep_layer_peak_bytes`) with every chunk's sent and received rows, so
the dispatch plan of all chunks, the all-to-alls' rows and their gradients are in it (equal to the
live-storage tracker's peak of the experts' call with recompute, a little above it without), plus
the router node and one all-to-all buffer that gloo may free late (:meth:`ChunkPolicy.ep_peak`).
Without ``chunk_rows``, rows beyond T·k and the rows a transport layer keeps
(``transport_row_elements``) are added to the exact local peak at the timeline's per-row slope
(:func:`memfine.memory.layer.expert_row_bytes`), per chunk: ⌈s″/c⌉ rows, an estimate (it misses
the plan and the all-to-all buffers). On one process s″ ≤ T·k and the prediction is the
timeline's peak itself.

Expert parallelism: every rank of an EP group must run the same number of chunks (each chunk
issues its own all-to-all). The expert-parallel experts pass their agreement (an all-reduce MAX
over the ``ep`` group) as the ``agree`` argument of each decision; one process needs none.

Row blocks: with ``MoEConfig.backward_block_bytes=None`` a budgeted decision also picks the
fused path's rows per block, per bin from the device default down to a quarter of its rows
(:func:`memfine.config.ladder_block_rows`): the candidates are (c, rows) pairs, c first, so a
call that fits the budget with smaller blocks runs in fewer chunks, and a smaller c is always
preferred (a quarter block costs a few percent; a chunk its own routing index and, under expert
parallelism, its own all-to-alls: :data:`memfine.config.BUDGET_BLOCK_DIVISORS`). A set
``backward_block_bytes`` is the only block. The block is local to the rank (the all-to-alls are
per chunk), so only c is agreed over the expert-parallel group; the block is then the largest
that fits at the agreed c. Every plan and record carries rows (``ChunkPlan.block_rows``), resolved
here once per call from the config's bytes (or a rung) at the layer's d, n, G, D_t and device.

Every decision is recorded as a :class:`ChunkDecision` (``last_decision``), which
:class:`memfine.nn.MoELayer`, the transformers backend and the torchtitan converter expose.

Under ``torch.compile`` (:mod:`memfine.schedule.traced`) T is a symbolic size and s″ is not a
host number, so the decision is read from thresholds instead: :meth:`ChunkPolicy.token_limits`
gives per bin c the most tokens T_max(c) whose exact predicted peak fits the budget (MemFine
Eq. 8's s′_max, here in tokens with s″ = T·k rows), a function of the budget, the sizes, D_t,
the bins and the recompute mode only, and c is the first bin with T ≤ T_max(c) (Eq. 9), at the
default row block (a traced fused call runs as one block, so the ladder's smaller blocks are not
planned there). On one process the prediction is the same for every s″ ≤ T·k, so where the
default block fits this is the eager choice.

Reference: MemFine (arXiv 2511.21431) Eq. 8-9, §4.2 (MACT); docs/design.md §4; docs/style.md §7.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
import weakref
from collections.abc import Callable

from memfine.config import ChunkConfig, MoEConfig, ladder_block_rows
from memfine.memory import layer as layer_memory
from memfine.memory.planner import largest_fitting
from memfine.schedule.chunked import chunk_sizes
from memfine.schedule.decision import (
    CONFIG_NAMES,
    AgreeNumChunks,
    ChunkDecision,
    ChunkPlan,
    ChunkRows,
    InfeasibleBudgetError,
)
from memfine.units import format_bytes

_KEYS = itertools.count()
_POLICIES: weakref.WeakValueDictionary[int, ChunkPolicy] = weakref.WeakValueDictionary()


class ChunkPolicy:
    """Decides the chunk count c of an MoE layer call.

    One policy object may be shared by every MoE layer of a model (the over-budget warning is
    then given once per model; ``last_decision`` is the latest call's, read by each layer
    right after its own call).

    Args:
        chunk: the :class:`ChunkConfig` (fixed ``num_chunks`` or ``memory_budget_bytes``, bins,
            recompute mode, ``allow_over_budget``).
        moe: the layers' :class:`MoEConfig` (sizes for the memory model).

    Attributes:
        config: the chunk config.
        moe: the MoE config.
        last_decision: the :class:`ChunkDecision` of the latest eager call (None before any).
        key: an int naming this policy for :meth:`registered` (compiled code holds the int).

    Reference: MemFine Eq. 8-9, §4.2.
    """

    def __init__(self, chunk: ChunkConfig, moe: MoEConfig) -> None:
        """Keep the configs, start with an empty memory-model cache; arguments as on the class."""
        self.config = chunk
        self.moe = moe
        # the latest record, or (a fixed c) the deferred prediction that makes it when read
        self._last: ChunkDecision | Callable[[], ChunkDecision] | None = None
        self._warned = False
        # (T, D_t, recompute, c, block rows, device) → exact timeline peak; a step repeats one T
        self._peaks: dict[tuple[int, int, str, int, int, str], int] = {}
        self._row_bytes: dict[tuple[int, str, str], int] = {}
        self._limits: dict[tuple[int, str, str, bool], tuple[int, ...]] = {}
        self.key = next(_KEYS)
        _POLICIES[self.key] = self

    @staticmethod
    def registered(key: int) -> ChunkPolicy:
        """The live policy whose ``key`` is ``key``.

        Raises:
            KeyError: when no such policy is alive.
        """
        return _POLICIES[key]

    @property
    def last_decision(self) -> ChunkDecision | None:
        """The :class:`ChunkDecision` of the latest eager call (None before any).

        With a fixed c the prediction is made when this is first read, not per call: a layer
        that nobody asks replays no memory model (one replay per new T otherwise).
        """
        return self.record()()

    def record(self) -> Callable[[], ChunkDecision | None]:
        """The latest call's record as a getter, for a layer to keep (it stays that call's).

        The getter makes a fixed c's prediction on its first call and keeps it.
        """
        last = self._last
        if last is None or isinstance(last, ChunkDecision):
            return lambda: last
        return last

    @property
    def budgeted(self) -> bool:
        """True when c is chosen from a memory budget (MACT), False for a fixed c."""
        return self.config.memory_budget_bytes is not None

    def ladder(self, device_type: str = "cpu", dtype_bytes: int = 4) -> tuple[int, ...]:
        """The rows per block this policy's layer may run, largest first (the first: its own).

        :func:`memfine.config.ladder_block_rows` at the layer's dims in D_t; only the config's
        block when ``backward_block_bytes`` is set.
        """
        return ladder_block_rows(self.moe, dtype_bytes, device_type)

    def candidates(self, device_type: str = "cpu", dtype_bytes: int = 4
                   ) -> tuple[tuple[int, int], ...]:
        """The (c, rows per block) pairs a budgeted decision tries, in order of preference.

        Every bin c in order, and per bin the rows of :meth:`ladder`, largest first: the first
        pair whose predicted peak fits the budget is the choice. With a fixed c: that c at the
        config's block.
        """
        ladder = self.ladder(device_type, dtype_bytes)
        if not self.budgeted:
            return ((self.config.num_chunks, ladder[0]),)
        return tuple((c, block) for c in self.config.bins for block in ladder)

    def layer_peak(self, num_tokens: int, dtype_bytes: int, num_chunks: int, *,
                   recompute: str | None = None, device_type: str = "cpu",
                   block_rows: int | None = None) -> int:
        """The exact timeline peak of one layer call with T tokens at c chunks (cached), bytes.

        ``device_type``: the activations' device (the default row blocks and index builder the
        layer runs there). ``block_rows``: rows per fused row block (None: the config's own,
        :meth:`ladder`'s first).
        """
        rec = recompute or self.config.resolved_recompute
        rows = self.ladder(device_type, dtype_bytes)[0] if block_rows is None else block_rows
        key = (num_tokens, dtype_bytes, rec, num_chunks, rows, device_type)
        peak = self._peaks.get(key)
        if peak is None:
            if len(self._peaks) >= 256:  # varying T (e.g. a last, shorter batch): stay small
                self._peaks.clear()
            peak = self._peaks[key] = self.model_peak(num_tokens, dtype_bytes, num_chunks, rec,
                                                      device_type, rows)
        return peak

    def model_peak(self, num_tokens: int, dtype_bytes: int, num_chunks: int, recompute: str,
                   device_type: str, block_rows: int) -> int:
        """The memory model's peak of one layer call (uncached; a subclass's layer kind), bytes.

        :func:`memfine.memory.layer.layer_peak_bytes` of this policy's config at the call's
        rows per block.
        """
        return layer_memory.layer_peak_bytes(self.moe, num_tokens, dtype_bytes,
                                             num_chunks=num_chunks, recompute=recompute,
                                             device_type=device_type, block_rows=block_rows)

    def token_limits(self, dtype_bytes: int, device_type: str = "cpu", *,
                     all_blocks: bool = True) -> tuple[int, ...]:
        """T_max per candidate: the most tokens whose predicted layer peak fits the budget (cached).

        For each (c, block) of :meth:`candidates`, the largest T with :meth:`layer_peak`
        (T, D_t, c, block) ≤ the budget, found by :func:`memfine.memory.planner.largest_fitting`
        on host integers (the exact model's peak grows with T between the points where the
        ``auto`` index builder turns, which are checked with each T; tests prove both).
        With s″ ≤ T·k rows and no transport rows (one process) the first candidate with
        T ≤ T_max is :meth:`decide`'s choice for every T.

        Args:
            dtype_bytes: D_t.
            device_type: the activations' device (as :meth:`layer_peak`).
            all_blocks: False: each bin at the default row block only, one count per bin (what
                a compiled call plans: :func:`memfine.schedule.traced.traced_plan`).

        Returns:
            One count per candidate, in :meth:`candidates`' order (per bin without
            ``all_blocks``); -1 where even T = 0 does not fit.

        Raises:
            ValueError: without a budget.

        Reference: MemFine Eq. 8 (s′_max, here in tokens: s′_max = T_max·k) and Eq. 9.
        """
        budget = self.config.memory_budget_bytes
        if budget is None:
            raise ValueError("token_limits needs ChunkConfig.memory_budget_bytes")
        key = (dtype_bytes, self.config.resolved_recompute, device_type, all_blocks)
        if key not in self._limits:

            def fits(num_tokens: int, num_chunks: int, block: int) -> bool:
                # every T below fits too: the points where the index builder turns (the peak
                # may fall there) are checked with T (layer_memory.builder_switch_tokens)
                switches = layer_memory.builder_switch_tokens(self.moe, num_chunks, device_type)
                return all(self.layer_peak(t, dtype_bytes, num_chunks, device_type=device_type,
                                           block_rows=block) <= budget
                           for t in (*(s for s in switches if s < num_tokens), num_tokens))

            candidates = self.candidates(device_type, dtype_bytes)
            if not all_blocks:
                candidates = tuple((c, b) for c, b in candidates if b == candidates[0][1])
            self._limits[key] = tuple(
                largest_fitting(functools.partial(fits, num_chunks=c, block=block))
                for c, block in candidates)
        return self._limits[key]

    def row_bytes(self, dtype_bytes: int, device_type: str = "cpu") -> int:
        """The timeline's peak bytes per received row of one chunk (its largest slope)."""
        key = (dtype_bytes, self.config.resolved_recompute, device_type)
        if key not in self._row_bytes:
            self._row_bytes[key] = layer_memory.expert_row_bytes(
                self.moe, dtype_bytes, recompute=key[1], device_type=device_type)
        return self._row_bytes[key]

    def predicted_peak(self, recv_rows: int, num_tokens: int, dtype_bytes: int,
                       num_chunks: int, *, transport_row_elements: int = 0,
                       device_type: str = "cpu", block_rows: int | None = None,
                       chunk_rows: ChunkRows | None = None) -> int:
        """Predicted peak of one layer call at c chunks with s″ received rows, in bytes.

        With ``chunk_rows`` (expert parallelism): the expert-parallel layer timeline
        (:func:`memfine.memory.layer.ep_layer_peak_bytes`) with the chunks' own (sent,
        received) rows (a c outside them: C·k sent and ⌈s″/c⌉ received per chunk); an upper
        bound of the measured peak. Otherwise the exact timeline peak for T tokens
        (S = T·k rows), plus, per chunk, the rows received beyond ⌈T/c⌉·k at the per-row slope
        and ``transport_row_elements`` · D_t per received row (both 0 on one process).

        Args:
            recv_rows: s″ (≥ 0).
            num_tokens: T (≥ 0).
            dtype_bytes: D_t.
            num_chunks: c ≥ 1.
            transport_row_elements: elements per received row kept by a transport layer.
            device_type: the activations' device (as :meth:`layer_peak`).
            block_rows: rows per fused row block (None: the config's own).
            chunk_rows: the chunks' rows of an expert-parallel call, or None.
        """
        if chunk_rows is not None:
            return self.ep_peak(recv_rows, num_tokens, dtype_bytes, num_chunks, chunk_rows,
                                device_type=device_type, block_rows=block_rows)
        peak = self.layer_peak(num_tokens, dtype_bytes, num_chunks, device_type=device_type,
                               block_rows=block_rows)
        rows = math.ceil(recv_rows / num_chunks)
        extra = max(0, rows - math.ceil(num_tokens / num_chunks) * self.moe.top_k)
        if extra:
            peak += extra * self.row_bytes(dtype_bytes, device_type)
        return peak + rows * transport_row_elements * dtype_bytes

    def ep_peak(self, recv_rows: int, num_tokens: int, dtype_bytes: int, num_chunks: int,
                chunk_rows: ChunkRows, *, device_type: str = "cpu",
                block_rows: int | None = None) -> int:
        """The expert-parallel layer timeline's peak at c chunks, bytes.

        Plus one chunk's largest all-to-all buffer, max(M, S)·d·D_t: gloo may drop its
        reference to an all-to-all's tensors from its own thread after the call returned, so on
        a rank that waited for the others one such buffer can still be alive at the peak (a late
        free the program does not control). Not cached: the rows change every call. Arguments
        as :meth:`predicted_peak`.
        """
        rows = chunk_rows.rows.get(num_chunks)
        if rows is None:  # an even split: every chunk sends C·k rows, receives ⌈s″/c⌉
            received = math.ceil(recv_rows / num_chunks)
            rows = tuple((C * self.moe.top_k, received)
                         for C in chunk_sizes(num_tokens, num_chunks))
        block = self.ladder(device_type, dtype_bytes)[0] if block_rows is None else block_rows
        late_free = max(max(sent, received) for sent, received in rows)
        return late_free * self.moe.hidden_size * dtype_bytes + layer_memory.ep_layer_peak_bytes(
            self.moe, num_tokens, dtype_bytes, rows, local_experts=chunk_rows.local_experts,
            recompute=self.config.resolved_recompute, device_type=device_type, block_rows=block)

    def least_memory_plan(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
                          transport_row_elements: int = 0, device_type: str = "cpu"
                          ) -> tuple[ChunkPlan, int]:
        """The (c, rows per block) with the least predicted peak, and that peak in bytes.

        Over every bin and every block of :meth:`ladder` (the candidates of a budget); ties go
        to the smaller c, then the smaller block.
        """
        ladder = self.ladder(device_type, dtype_bytes)
        peak, c, block = min(
            (self.predicted_peak(recv_rows, num_tokens, dtype_bytes, c,
                                 transport_row_elements=transport_row_elements,
                                 device_type=device_type, block_rows=block), c, block)
            for c in self.config.bins for block in ladder)
        return ChunkPlan(c, block), peak

    def smallest_feasible_budget(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
                                 transport_row_elements: int = 0, device_type: str = "cpu"
                                 ) -> int:
        """The least budget that some candidate meets: the least predicted peak, bytes.

        :meth:`least_memory_plan`'s peak (every bin and row block a budget may run).
        """
        return self.least_memory_plan(recv_rows, num_tokens, dtype_bytes,
                                      transport_row_elements=transport_row_elements,
                                      device_type=device_type)[1]

    def decide(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
               agree: AgreeNumChunks | None = None,
               transport_row_elements: int = 0, device_type: str = "cpu",
               chunk_rows: ChunkRows | None = None) -> ChunkDecision:
        """The :class:`ChunkDecision` of one MoE layer call on this rank (also ``last_decision``).

        Args:
            recv_rows: s″, rows this rank's experts receive this step (locally: the valid
                (token, slot) pairs; under EP: the rows arriving from the count exchange);
                ignored (pass 0) without a budget.
            num_tokens: T, tokens entering the layer on this rank.
            dtype_bytes: D_t, bytes per activation element (4 for fp32, 2 for bf16).
            agree: the agreement of this call (the expert-parallel experts pass their
                all-reduce MAX over ``ep``); None on one process.
            transport_row_elements: elements per received row held by the experts' transport
                (the experts contract's ``transport_row_elements``: d under expert parallelism,
                0 locally).
            device_type: the activations' device type (``x.device.type``): the memory model
                takes the row blocks and index builder the layer runs there.
            chunk_rows: the chunks' rows of an expert-parallel call (:meth:`predicted_peak`),
                or None.

        Returns:
            Without a budget: ``ChunkConfig.num_chunks`` at the config's row blocks. With one:
            the first (c, block) of :meth:`candidates` whose predicted peak is within the
            budget, c agreed over the group and then the largest block that fits at that c
            (the largest bin at its smallest-peak block when over budget and
            ``allow_over_budget``).

        Raises:
            ValueError: if recv_rows or num_tokens is negative.
            InfeasibleBudgetError: if no candidate meets the budget (on this or another rank of
                the group) and ``allow_over_budget`` is False; one line naming the ChunkConfig
                fields and the smallest feasible budget.

        Side effects: calls ``agree`` once (budget mode only); warns once per policy object
        (``UserWarning``) when over budget with ``allow_over_budget``.

        Reference: MemFine Eq. 8-9 and §4.2 (bins, MACT), with the exact memory model.
        """
        if recv_rows < 0 or num_tokens < 0:
            raise ValueError(f"recv_rows and num_tokens must be >= 0, got {recv_rows}, "
                             f"{num_tokens}")
        rec, budget, extra = (self.config.resolved_recompute, self.config.memory_budget_bytes,
                              transport_row_elements)
        candidates = self.candidates(device_type, dtype_bytes)
        if budget is None:
            self._last = self._fixed_decision(num_tokens, dtype_bytes, extra, device_type)
            return self._last
        bins = self.config.bins
        peaks = {(c, block): self.predicted_peak(
                     recv_rows, num_tokens, dtype_bytes, c, transport_row_elements=extra,
                     device_type=device_type, block_rows=block, chunk_rows=chunk_rows)
                 for c, block in candidates}
        fits = next((c for c, block in candidates if peaks[c, block] <= budget), None)
        # over budget: a value above the largest bin, so every rank reaches the same verdict
        local = fits if fits is not None else bins[-1] + 1
        agreed = int(agree(local)) if agree is not None else local
        if agreed <= bins[-1]:
            c = min(b for b in bins if b >= agreed)
        else:
            err = self._over_budget(peaks, recv_rows, num_tokens, agreed, fits)
            if not self.config.allow_over_budget:
                raise err
            if not self._warned:
                self._warned = True
                warnings.warn(f"{err.message(CONFIG_NAMES)}; using the largest bin "
                              f"c={bins[-1]} (allow_over_budget)", UserWarning, stacklevel=2)
            c = bins[-1]
        at_c = [(peak, key[1]) for key, peak in peaks.items() if key[0] == c]
        block = next((blk for peak, blk in at_c if peak <= budget),
                     min(at_c)[1])
        decision = ChunkDecision(c, rec, recv_rows, peaks[c, block], budget, block)
        self._last = decision
        return decision

    def _fixed_decision(self, num_tokens: int, dtype_bytes: int, transport_row_elements: int,
                        device_type: str) -> ChunkDecision:
        """The record of a call at the fixed c: T·k rows (no count read) and their prediction."""
        c, block = self.candidates(device_type, dtype_bytes)[0]
        rows = num_tokens * self.moe.top_k
        return ChunkDecision(c, self.config.resolved_recompute, rows, self.predicted_peak(
            rows, num_tokens, dtype_bytes, c, transport_row_elements=transport_row_elements,
            device_type=device_type, block_rows=block), None, block)

    def plan(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
             agree: AgreeNumChunks | None = None, transport_row_elements: int = 0,
             device_type: str = "cpu", chunk_rows: ChunkRows | None = None) -> ChunkPlan:
        """The :class:`ChunkPlan` of one MoE layer call: :meth:`decide`'s c and row blocks.

        Arguments and errors as :meth:`decide`. Without a budget the plan's ``block_rows`` are
        the config's own and nothing is predicted: the record's prediction is made
        when :attr:`last_decision` is read; under ``torch.compile`` tracing with a fixed c
        nothing is recorded (the count is the config's; the memory model runs on host integers
        only).
        """
        if not self.budgeted:
            if not _compiling():  # the record, predicted only when read (no replay per T)
                self._last = functools.cache(functools.partial(
                    self._fixed_decision, num_tokens, dtype_bytes, transport_row_elements,
                    device_type))
            return ChunkPlan(self.config.num_chunks, self.ladder(device_type, dtype_bytes)[0])
        decision = self.decide(recv_rows, num_tokens, dtype_bytes, agree=agree,
                               transport_row_elements=transport_row_elements,
                               device_type=device_type, chunk_rows=chunk_rows)
        return ChunkPlan(decision.num_chunks, decision.block_rows)

    def num_chunks(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
                   agree: AgreeNumChunks | None = None, transport_row_elements: int = 0,
                   device_type: str = "cpu", chunk_rows: ChunkRows | None = None) -> int:
        """C of one MoE layer call: :meth:`plan`'s ``num_chunks`` (arguments, errors as there)."""
        return self.plan(recv_rows, num_tokens, dtype_bytes, agree=agree,
                         transport_row_elements=transport_row_elements,
                         device_type=device_type, chunk_rows=chunk_rows).num_chunks

    def _over_budget(self, peaks: dict[tuple[int, int], int], recv_rows: int,
                     num_tokens: int,
                     agreed: int, fits: int | None) -> InfeasibleBudgetError:
        """The error of a budget no candidate meets: why, and the smallest feasible budget."""
        bins, budget = self.config.bins, self.config.memory_budget_bytes
        assert budget is not None
        best = min(peaks, key=lambda key: (peaks[key], *key))
        if fits is not None:
            reason = (f"another rank of the expert-parallel group needs c={agreed} > largest "
                      f"bin {bins[-1]}")
        else:
            reason = (f"with T={num_tokens} tokens and s''={recv_rows} received rows the "
                      f"predicted layer peak is {format_bytes(peaks[best], exact=True)} at "
                      f"best (c={best[0]}, {block_text(best[1])})")
        return InfeasibleBudgetError(budget, peaks[best], bins, reason)


def block_text(block_rows: int | None) -> str:
    """Rows per row block in words (``row blocks of 128 rows``; None: the config's)."""
    return "the config's row blocks" if block_rows is None else f"row blocks of {block_rows} rows"


def _compiling() -> bool:
    """True while ``torch.compile`` traces (imported lazily: the policy is host arithmetic)."""
    import torch

    return bool(torch.compiler.is_compiling())
