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

Reference: MemFine (arXiv 2511.21431) Eq. 8-9, §4.2 (MACT); docs/design.md §4; docs/style.md §7.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

from memfine.config import ChunkConfig, MoEConfig
from memfine.memory import layer as layer_memory
from memfine.memory.planner import choose_num_chunks, s_prime_max
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
        """Keep the configs and start with empty memory-model caches; arguments as on the class."""
        self.config = chunk
        self.moe = moe
        self.agree_num_chunks: AgreeNumChunks = agree_num_chunks or identity_agreement
        self._warned = False
        # Runtime (not config): elements per received row held outside the expert computation
        # by a transport layer, e.g. expert parallelism's received copy of x and the gradient
        # returning through the all-to-all; added to the memory model's per-row bytes.
        self.transport_row_elements = 0
        # The memory model is pure in (config, T, D_t): cache its answers, since the policy is
        # asked on every step of every layer.
        self._row_cache: dict[int, int] = {}
        self._fixed_cache: dict[tuple[int, int], int] = {}

    @property
    def budgeted(self) -> bool:
        """True when c is chosen from a memory budget (MACT), False for a fixed c."""
        return self.config.memory_budget_bytes is not None

    def row_bytes(self, dtype_bytes: int) -> int:
        """Peak bytes per received row of one chunk (memory model, this recompute mode)."""
        if dtype_bytes not in self._row_cache:
            self._row_cache[dtype_bytes] = layer_memory.expert_row_bytes(
                self.moe, dtype_bytes, recompute=self.config.resolved_recompute)
        return self._row_cache[dtype_bytes] + self.transport_row_elements * dtype_bytes

    def fixed_bytes(self, num_tokens: int, dtype_bytes: int) -> int:
        """Bytes of the layer that do not scale with the received rows (memory model)."""
        key = (num_tokens, dtype_bytes)
        if key not in self._fixed_cache:
            if len(self._fixed_cache) >= 64:  # varying T (e.g. last batch): keep it small
                self._fixed_cache.clear()
            self._fixed_cache[key] = layer_memory.expert_fixed_bytes(
                num_tokens, self.moe, dtype_bytes, recompute=self.config.resolved_recompute)
        return self._fixed_cache[key]

    def s_prime_max(self, num_tokens: int, dtype_bytes: int) -> int:
        """s′_max: the most received rows one chunk may hold within the budget (Eq. 8).

        Args:
            num_tokens: T, tokens entering the layer on this rank.
            dtype_bytes: D_t, bytes per activation element.

        Returns:
            Rows; ≤ 0 when the budget does not even cover the fixed part.

        Raises:
            ValueError: when no budget is configured.
        """
        budget = self.config.memory_budget_bytes
        if budget is None:
            raise ValueError("ChunkPolicy.s_prime_max needs ChunkConfig.memory_budget_bytes")
        return s_prime_max(budget, self.fixed_bytes(num_tokens, dtype_bytes),
                           self.row_bytes(dtype_bytes))

    def smallest_feasible_budget(self, recv_rows: int, num_tokens: int, dtype_bytes: int) -> int:
        """The least budget for which the largest bin keeps a chunk within it, in bytes.

        fixed + ⌈max(s″, 1) / c_max⌉ · row bytes, with c_max the largest bin.
        """
        rows = math.ceil(max(recv_rows, 1) / self.config.bins[-1])
        return self.fixed_bytes(num_tokens, dtype_bytes) + rows * self.row_bytes(dtype_bytes)

    def _local_num_chunks(self, recv_rows: int, s_max: int) -> int:
        """The smallest bin ≥ ⌈s″/s′_max⌉, or largest bin + 1 when none is large enough."""
        bins = self.config.bins
        if s_max <= 0:
            return bins[-1] + 1
        needed = max(1, math.ceil(recv_rows / s_max))
        return choose_num_chunks(recv_rows, s_max, bins) if needed <= bins[-1] else needed

    def num_chunks(self, recv_rows: int, num_tokens: int, dtype_bytes: int, *,
                   agree: AgreeNumChunks | None = None) -> int:
        """Chunk count c for one MoE layer call on this rank.

        Args:
            recv_rows: s″, rows this rank's experts receive this step (locally: the valid
                (token, slot) pairs; under EP: the rows arriving from the count exchange).
            num_tokens: T, tokens entering the layer on this rank.
            dtype_bytes: D_t, bytes per activation element (4 for fp32, 2 for bf16).
            agree: the agreement of this call (the expert-parallel experts pass their
                all-reduce MAX over ``ep``); default ``agree_num_chunks``.

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
        bins = self.config.bins
        s_max = self.s_prime_max(num_tokens, dtype_bytes)
        local = self._local_num_chunks(recv_rows, s_max)
        agreed = int((agree or self.agree_num_chunks)(local))
        if agreed <= bins[-1]:
            return agreed
        budget = self.config.memory_budget_bytes
        assert budget is not None, "budgeted policy without a budget"
        if local > bins[-1]:
            need = self.smallest_feasible_budget(recv_rows, num_tokens, dtype_bytes)
            reason = (f"s''={recv_rows} received rows with s'_max={s_max} rows per chunk need "
                      f"c={local} > largest bin {bins[-1]}; the smallest feasible budget is "
                      f"{format_bytes(need, exact=True)}")
        else:
            reason = (f"another rank of the expert-parallel group needs c={agreed} > largest "
                      f"bin {bins[-1]}")
        msg = (f"ChunkConfig.memory_budget_bytes={format_bytes(budget, exact=True)} cannot be "
               f"met: {reason}")
        if not self.config.allow_over_budget:
            raise ValueError(msg + "; raise the budget, add a larger bin, or set "
                             "allow_over_budget to run with the largest bin")
        if not self._warned:
            self._warned = True
            warnings.warn(msg + f"; using the largest bin c={bins[-1]} (allow_over_budget)",
                          UserWarning, stacklevel=2)
        return bins[-1]
