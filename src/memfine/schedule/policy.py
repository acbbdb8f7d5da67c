"""Runtime chunk policy: a fixed chunk count, or MACT's budget-driven choice per step and layer.

With ``ChunkConfig.memory_budget_bytes`` set, every call of an MoE layer reads the rows its
experts receive this step (s″), turns the budget into the largest tolerable rows per chunk with the
memory model (s′_max, MemFine Eq. 8) and picks c = ⌈s″/s′_max⌉ rounded up to the configured bins
(Eq. 9). Without a budget, c = ``ChunkConfig.num_chunks``.

Expert parallelism: every rank of an EP group must run the same number of chunks (each chunk
issues its own all-to-all). The policy therefore passes its local choice through an injected
*agreement* callable, ``agree_num_chunks(c_local) -> c_group``, before using it. The default is the
identity (one process); the expert-parallel code plugs in an all-reduce with ``MAX`` over the EP
group. Configs hold plain values only, so the callable is a constructor argument (and a public,
assignable attribute), never a config field.

What a transport layer keeps per received row beside the experts' own bytes (expert parallelism's
received copy of x: d elements) is an argument of each decision, ``transport_row_elements``: the
experts that call the policy state it (their ``transport_row_elements`` in the experts contract,
:mod:`memfine.nn.experts`), so one policy serves local and expert-parallel experts unchanged.

Reference: MemFine (arXiv 2511.21431) Eq. 8-9, §4.2 (MACT); docs/design.md §4; docs/style.md §7.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

from memfine.config import ChunkConfig, MoEConfig
from memfine.memory import layer as layer_memory
from memfine.memory.layer import ChunkBytes
from memfine.memory.planner import ChunkChoice, choose_num_chunks, s_prime_max
from memfine.units import format_bytes

AgreeNumChunks = Callable[[int], int]
"""``agree_num_chunks(c_local) -> c_group``: the group's maximum of every rank's local choice.

Called once per budget-driven decision (per step and MoE layer, in forward only, never during
recompute), on every rank of the group in the same order. Its argument is the local chunk count:
a configured bin, or a value above the largest bin when this rank cannot meet its budget (so that
all ranks reach the same verdict). It must return the maximum over the group (an all-reduce MAX);
the return value is used as is.
"""

def identity_agreement(num_chunks: int) -> int:
    """The single-process agreement: return ``num_chunks`` unchanged."""
    return num_chunks


class ChunkPolicy:
    """Decides the chunk count c of an MoE layer call.

    One policy object may be shared by every MoE layer of a model (the over-budget warning is
    then given once per model).

    Args:
        chunk: the :class:`ChunkConfig` (fixed ``num_chunks`` or ``memory_budget_bytes``, bins,
            recompute mode, ``allow_over_budget``).
        moe: the layers' :class:`MoEConfig` (sizes for the memory model).
        agree_num_chunks: see :data:`AgreeNumChunks`; default :func:`identity_agreement`.

    Attributes:
        config: the chunk config.
        moe: the MoE config.
        agree_num_chunks: the agreement callable; assign to it to plug in an EP group's
            all-reduce MAX after the model is built.

    Reference: MemFine Eq. 8-9, §4.2.
    """

    def __init__(self, chunk: ChunkConfig, moe: MoEConfig, *,
                 agree_num_chunks: AgreeNumChunks | None = None) -> None:
        """Keep the configs, start with an empty memory-model cache; arguments as on the class."""
        self.config = chunk
        self.moe = moe
        self.agree_num_chunks: AgreeNumChunks = agree_num_chunks or identity_agreement
        self._warned = False
        # The memory model is pure in (config, T, D_t) and the policy is asked on every step of
        # every layer: its line fixed + row·rows, once per (T, D_t); the only cache.
        self._lines: dict[tuple[int, int], ChunkBytes] = {}

    @property
    def budgeted(self) -> bool:
        """True when c is chosen from a memory budget (MACT), False for a fixed c."""
        return self.config.memory_budget_bytes is not None

    def chunk_bytes(self, num_tokens: int, dtype_bytes: int, *,
                    transport_row_elements: int = 0) -> ChunkBytes:
        """The memory model's ``fixed + row · rows`` line for T tokens (transport rows included).

        Args:
            num_tokens: T, tokens entering the layer on this rank.
            dtype_bytes: D_t, bytes per activation element.
            transport_row_elements: elements per received row that a transport layer holds
                outside the expert computation (expert parallelism: the received copy of x, d);
                0 for local experts.

        Returns:
            :class:`memfine.memory.layer.ChunkBytes`; ``row_bytes`` includes
            ``transport_row_elements · D_t``.
        """
        key = (num_tokens, dtype_bytes)
        line = self._lines.get(key)
        if line is None:
            if len(self._lines) >= 64:  # varying T (e.g. a last, shorter batch): stay small
                self._lines.clear()
            line = self._lines[key] = layer_memory.chunk_bytes(
                num_tokens, self.moe, dtype_bytes, recompute=self.config.resolved_recompute)
        extra = transport_row_elements * dtype_bytes
        return dataclasses.replace(line, row_bytes=line.row_bytes + extra) if extra else line

    def row_bytes(self, dtype_bytes: int, num_tokens: int = 0, *,
                  transport_row_elements: int = 0) -> int:
        """Peak bytes per received row of one chunk (memory model, this recompute mode)."""
        return self.chunk_bytes(num_tokens, dtype_bytes,
                                transport_row_elements=transport_row_elements).row_bytes

    def fixed_bytes(self, num_tokens: int, dtype_bytes: int) -> int:
        """Bytes of the layer that do not scale with the received rows (memory model)."""
        return self.chunk_bytes(num_tokens, dtype_bytes).fixed_bytes

    def s_prime_max(self, num_tokens: int, dtype_bytes: int, *,
                    transport_row_elements: int = 0) -> int:
        """s′_max: the most received rows one chunk may hold within the budget (Eq. 8).

        Args:
            num_tokens: T, tokens entering the layer on this rank.
            dtype_bytes: D_t, bytes per activation element.
            transport_row_elements: as :meth:`chunk_bytes`.

        Returns:
            Rows; ≤ 0 when the budget does not even cover the fixed part.

        Raises:
            ValueError: when no budget is configured.
        """
        budget = self.config.memory_budget_bytes
        if budget is None:
            raise ValueError("ChunkPolicy.s_prime_max needs ChunkConfig.memory_budget_bytes")
        line = self.chunk_bytes(num_tokens, dtype_bytes,
                                transport_row_elements=transport_row_elements)
        return s_prime_max(budget, line.fixed_bytes, line.row_bytes)

    def smallest_feasible_budget(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
                                 transport_row_elements: int = 0) -> int:
        """The least budget for which the largest bin keeps a chunk within it, in bytes.

        fixed + ⌈max(s″, 1) / c_max⌉ · row bytes, with c_max the largest bin
        (``transport_row_elements`` as :meth:`chunk_bytes`).
        """
        line = self.chunk_bytes(num_tokens, dtype_bytes,
                                transport_row_elements=transport_row_elements)
        rows = math.ceil(max(recv_rows, 1) / self.config.bins[-1])
        return line.fixed_bytes + rows * line.row_bytes

    def num_chunks(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
                   agree: AgreeNumChunks | None = None, transport_row_elements: int = 0) -> int:
        """Chunk count c for one MoE layer call on this rank.

        Args:
            recv_rows: s″, rows this rank's experts receive this step (locally: the valid
                (token, slot) pairs; under EP: the rows arriving from the count exchange).
            num_tokens: T, tokens entering the layer on this rank.
            dtype_bytes: D_t, bytes per activation element (4 for fp32, 2 for bf16).
            agree: the agreement of this call (the expert-parallel experts pass their
                all-reduce MAX over ``ep``); default ``agree_num_chunks``.
            transport_row_elements: elements per received row held by the experts' transport
                (the experts contract's ``transport_row_elements``: d under expert parallelism,
                0 locally), added to the memory model's per-row bytes.

        Returns:
            c: ``ChunkConfig.num_chunks`` without a budget; with one, the group-agreed bin (the
            largest bin when over budget and ``allow_over_budget``).

        Raises:
            ValueError: if recv_rows or num_tokens is negative, or if even the largest bin cannot
                meet the budget (the message names the smallest feasible budget in bytes and
                MiB/GiB) and ``allow_over_budget`` is False.

        Side effects: calls ``agree`` (or ``agree_num_chunks``) once (budget mode only); warns
        once per policy object (``UserWarning``) when over budget with ``allow_over_budget``.

        Reference: MemFine Eq. 8 (s′_max), Eq. 9 and §4.2 (bins, MACT).
        """
        if recv_rows < 0 or num_tokens < 0:
            raise ValueError(f"recv_rows and num_tokens must be >= 0, got {recv_rows}, "
                             f"{num_tokens}")
        if not self.budgeted:
            return self.config.num_chunks
        bins, extra = self.config.bins, transport_row_elements
        s_max = self.s_prime_max(num_tokens, dtype_bytes, transport_row_elements=extra)
        choice = choose_num_chunks(recv_rows, s_max, bins)
        # over budget: a value above the largest bin, so every rank reaches the same verdict
        local = choice.num_chunks or max(bins[-1] + 1, choice.chunks_needed or 0)
        agreed = int((agree or self.agree_num_chunks)(local))
        if agreed <= bins[-1]:
            return agreed
        msg = self._over_budget(choice, recv_rows, num_tokens, dtype_bytes, agreed=agreed,
                                transport_row_elements=extra)
        if not self.config.allow_over_budget:
            raise ValueError(msg + "; raise ChunkConfig.memory_budget_bytes, add a larger bin to "
                             "ChunkConfig.bins, or set ChunkConfig.allow_over_budget to run with "
                             "the largest bin")
        if not self._warned:
            self._warned = True
            warnings.warn(msg + f"; using the largest bin c={bins[-1]} (allow_over_budget)",
                          UserWarning, stacklevel=2)
        return bins[-1]

    def _over_budget(self, choice: ChunkChoice, recv_rows: int, num_tokens: int,
                     dtype_bytes: int, *, agreed: int, transport_row_elements: int) -> str:
        """The message of a budget no bin meets: why, and the smallest feasible budget."""
        bins, budget = self.config.bins, self.config.memory_budget_bytes
        extra = transport_row_elements
        s_max = self.s_prime_max(num_tokens, dtype_bytes, transport_row_elements=extra)
        if choice.num_chunks is not None:
            reason = (f"another rank of the expert-parallel group needs c={agreed} > largest "
                      f"bin {bins[-1]}")
        else:
            need = self.smallest_feasible_budget(recv_rows, num_tokens, dtype_bytes,
                                                 transport_row_elements=extra)
            if choice.chunks_needed is None:
                fixed = self.fixed_bytes(num_tokens, dtype_bytes)
                reason = (f"s'_max={s_max} rows: the budget does not cover the "
                          f"{format_bytes(fixed, exact=True)} that do not scale with the rows")
            else:
                reason = (f"s''={recv_rows} received rows with s'_max={s_max} rows per chunk "
                          f"need c={choice.chunks_needed} > largest bin {bins[-1]}")
            reason += f"; the smallest feasible budget is {format_bytes(need, exact=True)}"
        return (f"ChunkConfig.memory_budget_bytes = {format_bytes(budget, exact=True)} cannot be "
                f"met with ChunkConfig.bins {bins}: {reason}")
