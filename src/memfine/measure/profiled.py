"""Peak live bytes from ``torch.profiler``'s allocator events: the CPU ground truth.

:class:`ProfiledPeakMemory` runs the region under ``torch.profiler.profile(profile_memory=True)``
and replays the allocator's allocation and free events in time order after the region. Unlike
the live-storage tracker (:class:`memfine.measure.peak.PeakMemoryTracker`), it does not change
what the program does: any ``TorchDispatchMode`` gives every operator output a Python object,
which keeps an extra reference to its storage, so the autograd engine can no longer sum two
gradients of one input in place (``InputBuffer`` falls back to an out-of-place ``add``). Under the
tracker a gradient accumulated in the engine's buffer therefore costs one extra buffer of its size
that the uninstrumented program never allocates. memfine's own chunk loop accumulates weight
gradients itself (:mod:`memfine.ops.weight_grads`), so on memfine's layer both
measurements agree except where the engine sums a gradient (e.g. the layer input's gradient
from the router and from the experts); tests/measure/test_profiled.py checks where.

What is counted: bytes the CPU allocator hands out inside the region while they are alive, every
allocation (scalar tensors Python creates for literal arguments included), above what was alive at
entry; frees of blocks allocated before the region are not reported by the profiler and are
ignored. Values are known only after the ``with`` block: :meth:`ProfiledPeakMemory.mark` records
a point in time, the bytes alive there are computed at exit.

Reference: docs/design.md §8 (measurement on CPU), docs/style.md §7.
"""

from __future__ import annotations

from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

_MARK_PREFIX = "memfine.mark."


def _walk(node: Any, allocs: list[tuple[int, int, int, int]], marks: list[tuple[int, str]]
          ) -> None:
    """Collect (time ns, order, bytes, ptr) allocation events and (time ns, name) markers."""
    if node.tag == _EventType.Allocation:
        fields = node.extra_fields
        allocs.append((node.start_time_ns, len(allocs), fields.alloc_size, fields.ptr))
    elif node.name.startswith(_MARK_PREFIX):
        marks.append((node.start_time_ns, node.name[len(_MARK_PREFIX):]))
    for child in node.children:
        _walk(child, allocs, marks)


class ProfiledPeakMemory:
    """Context manager: peak live allocator bytes of a region, from ``torch.profiler`` (CPU).

    Same attributes as :class:`memfine.measure.peak.PeakMemoryTracker` after exit, so
    :func:`memfine.measure.measure_memory` can use either.

    Attributes (valid after exit):
        peak_bytes: largest bytes alive at once, above what was alive at entry.
        current_bytes: bytes allocated inside and alive at exit.
        baseline_bytes: ``None`` (not measured on the CPU).
        marks: ``{name: bytes alive at the mark}``.
        phase_peaks: ``{name: peak of the phase ending at that mark}``; the phase after the last
            mark is ``"end"``.

    Raises:
        RuntimeError: when entered twice, when ``mark`` is called outside the region, or when a
            byte count is read before exit.

    Memory: the profiler keeps one event per operator and allocation of the region (host memory
    outside torch's allocator; not counted).
    """

    def __init__(self) -> None:
        """Create an unentered measurement."""
        self.baseline_bytes: int | None = None
        self.marks: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self._prof: profile | None = None
        self._entered = self._inside = self._done = False
        self._peak = self._current = 0

    def __enter__(self) -> ProfiledPeakMemory:
        """Start the profiler.

        Raises:
            RuntimeError: when this measurement was entered before.
        """
        if self._entered:
            raise RuntimeError("ProfiledPeakMemory can be entered only once; create a new one")
        self._entered = self._inside = True
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Record the current point in time under ``name`` (bytes are computed at exit).

        Raises:
            RuntimeError: outside the ``with`` block.
        """
        if not self._inside:
            raise RuntimeError("ProfiledPeakMemory.mark must be called inside the with block")
        with record_function(_MARK_PREFIX + name):
            pass

    def __exit__(self, *exc: object) -> None:
        """Stop the profiler and replay its allocation events (exceptions are not suppressed)."""
        assert self._prof is not None, "entered before exit"
        self._prof.__exit__(None, None, None)
        self._inside = False
        allocs: list[tuple[int, int, int, int]] = []
        marks: list[tuple[int, str]] = []
        profiler = self._prof.profiler
        results = profiler.kineto_results if profiler is not None else None
        assert results is not None, "the profiler recorded no results"
        for root in results.experimental_event_tree():
            _walk(root, allocs, marks)
        self._replay(sorted(allocs), sorted(marks))
        self._prof = None
        self._done = True

    def _replay(self, allocs: list[tuple[int, int, int, int]],
                marks: list[tuple[int, str]]) -> None:
        """Running sum of live bytes over the events in time order; marks close phases."""
        events = sorted([(t, 1, order, nbytes, ptr, "") for t, order, nbytes, ptr in allocs]
                        + [(t, 0, i, 0, 0, name) for i, (t, name) in enumerate(marks)])
        live: dict[int, int] = {}
        current = peak = phase_peak = 0
        for _, is_alloc, _, nbytes, ptr, name in events:
            if not is_alloc:
                self.phase_peaks[name], self.marks[name] = phase_peak, current
                phase_peak = current
            elif nbytes > 0:
                live[ptr] = nbytes
                current += nbytes
            elif ptr in live:  # frees of blocks allocated before the region are not reported
                current -= live.pop(ptr)
            peak, phase_peak = max(peak, current), max(phase_peak, current)
        self.phase_peaks["end"] = phase_peak
        self._peak, self._current = peak, current

    def _check_done(self) -> None:
        if not self._done:
            raise RuntimeError("ProfiledPeakMemory values are known only after the with block")

    @property
    def peak_bytes(self) -> int:
        """Largest bytes alive at once in the region, above the entry state."""
        self._check_done()
        return self._peak

    @property
    def current_bytes(self) -> int:
        """Bytes allocated inside the region and alive at exit."""
        self._check_done()
        return self._current


def profiled_peak_bytes(fn: Any) -> int:
    """Run ``fn()`` under :class:`ProfiledPeakMemory` and return its peak bytes.

    Args:
        fn: a callable with no arguments (its result is dropped at the end of the region).

    Returns:
        Peak live allocator bytes of the call, above what was alive before it.
    """
    with ProfiledPeakMemory() as prof:
        fn()
    return prof.peak_bytes


__all__ = ["ProfiledPeakMemory", "profiled_peak_bytes"]

