"""The event log the timelines write: sizes, alloc/free events, the engine's gradient buffers.

:class:`Shape` holds the sizes, :class:`Timeline` the alloc/free of named byte counts (running and
peak live bytes, phase marks), :class:`WeightGrads` the autograd engine's input buffers of the
expert weights while gradients arrive.

Integer arithmetic only: nothing is allocated. Legend as :mod:`memfine.timeline.experts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfine.config import ACTIVATIONS_SAVING_OUTPUT, MoEConfig


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes one simulation needs (all ints; bytes per element in ``dt``/``r``).

    ``device_type``: the activations' device, for the choices the code makes by device (the
    ``auto`` index builder's size limit). ``block_rows``: rows per row block of the fused
    forward and backward, as the layer call runs them (:func:`memfine.config.config_block_rows`
    resolves a config's).
    """

    moe: MoEConfig
    T: int
    dt: int
    device_type: str = "cpu"
    block_rows: int = field(kw_only=True)

    @property
    def r(self) -> int:
        """Router bytes per element: fp32, or float64 for float64 activations."""
        return 8 if self.dt == 8 else 4

    @property
    def cast(self) -> bool:
        """True when the router works on a copy of x in another dtype."""
        return self.dt != self.r


@dataclass(slots=True)
class Timeline:
    """Running and peak live bytes over named allocations."""

    record: bool = True
    current: int = 0
    peak: int = 0
    live: dict[str, int] = field(default_factory=dict)
    peak_live: dict[str, int] = field(default_factory=dict)
    trace: list[int] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)
    phase_peaks: dict[str, int] = field(default_factory=dict)
    _phase_peak: int = 0

    def alloc(self, name: str, nbytes: int) -> str:
        """Allocate ``nbytes`` under ``name`` (made unique); returns the name used."""
        key, i = name, 1
        while key in self.live:
            i += 1
            key = f"{name}#{i}"
        self.live[key] = nbytes
        self.current += nbytes
        if self.record:
            self.trace.append(self.current)
        self._phase_peak = max(self._phase_peak, self.current)
        if self.current > self.peak:
            self.peak = self.current
            if self.record:
                self.peak_live = dict(self.live)
        return key

    def free(self, *names: str) -> None:
        """Free the named allocations."""
        for name in names:
            self.current -= self.live.pop(name)
        if self.record:
            self.trace.append(self.current)

    def mark(self, name: str) -> None:
        """Record the live bytes now and close the current phase (its peak kept under name)."""
        self.marks[name] = self.current
        self.phase_peaks[name] = self._phase_peak
        self._phase_peak = self.current


def cat_chunks(tl: Timeline, parts: list[str], name: str, nbytes: int) -> str:
    """torch.cat of several chunk results (one new buffer), or the single part itself."""
    if len(parts) == 1:
        return parts[0]
    out = tl.alloc(name, nbytes)
    tl.free(*parts)
    return out


def engine_sum(tl: Timeline, first: str, incoming: str) -> str:
    """The autograd engine adds a later gradient of a tensor into the first one, in place.

    ``InputBuffer::accumulate`` with grad mode off reuses the first gradient when the engine
    holds its only reference (a fresh, dense result of the node that produced it): ``add_``,
    no new buffer; the incoming gradient is freed. Returns ``first``, now the sum. (Under a
    ``TorchDispatchMode``, e.g. the live-storage tracker, the engine adds out of place and holds
    a third buffer for a moment; torch.profiler sees the program as it runs.)
    """
    tl.free(incoming)
    return first


class WeightGrads:
    """The autograd engine's input buffers of w_up / w_down while chunks' gradients arrive.

    The first gradient is kept as is; each later one is added into it in place
    (:func:`engine_sum`) and freed once the node's outputs are handled.
    """

    def __init__(self, tl: Timeline) -> None:
        """Start with no buffer on ``tl``."""
        self.tl = tl
        self.buffer: dict[str, str] = {}

    def add(self, grads: dict[str, str], *names: str) -> None:
        """Accumulate the gradients ``grads[name]`` for ``names``, in order."""
        incoming = []
        for name in names:
            if name in self.buffer:  # added in place (engine_sum), freed below
                incoming.append(grads[name])
            else:
                self.buffer[name] = grads[name]
        self.tl.free(*incoming)


def expert_saved(moe: MoEConfig, C: int, S: int, dt: int) -> dict[str, int]:
    """Saved-for-backward bytes of one chunk's expert path (no recompute), by field.

    One formula for routed rows (k slots per token) and shared experts (k = S, every token).

    Args:
        moe: the experts' config (``experts_impl`` selects the fused or plain path).
        C: tokens of the chunk.
        S: rows the chunk's experts receive (C·k without sentinels).
        dt: D_t, bytes per activation element.

    Returns:
        :class:`memfine.memory.breakdown.MemoryBreakdown` field name → bytes.
    """
    D, N, G, E, K = (moe.hidden_size, moe.intermediate_size, moe.up_width, moe.num_experts,
                     moe.top_k)
    if moe.experts_impl == "fused":
        return {"pre_activation_bytes": S * G * dt,
                "routing_index_bytes": 4 * (2 * S + C * K + E + 1)}
    keeps_h = moe.activation not in ACTIVATIONS_SAVING_OUTPUT  # relu saves A, not H
    return {
        "pre_activation_bytes": S * G * dt if keeps_h else 0,
        "routing_index_bytes": 4 * (E + 1),  # offsets, saved by both grouped matmuls
        "gathered_input_bytes": S * D * dt + S * 8,
        "activation_output_bytes": S * N * dt * (2 if moe.gated else 1),
        "combine_copy_bytes": C * K * (D * dt + dt + 8 + 2),
    }
