"""One memory measurement of a forward + backward, and predicted-vs-measured tables.

:func:`measure_memory` combines the saved-for-backward tracker
(:class:`~memfine.measure.saved.SavedTensorsTracker`, active during forward) and the peak tracker
(:class:`~memfine.measure.peak.PeakMemoryTracker`, forward and backward) into a frozen
:class:`MemoryReport`. :func:`compare` and :func:`format_table` put predicted and measured bytes
side by side, one row per item; the same rows feed CSV files and ``memfine plan``.

Units: every ``*_bytes`` value is an ``int`` in bytes, or ``None`` when it was not measured
(shown as "not measured", never 0 or -1). Humans see MiB = 2^20 and GiB = 2^30 bytes.
Reference: docs/style.md §7; docs/design.md §8.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from memfine.measure.peak import PeakMemoryTracker
from memfine.measure.profiled import ProfiledPeakMemory
from memfine.measure.saved import SavedTensorsTracker
from memfine.units import NOT_MEASURED, format_bytes

PEAK_METHODS = ("tracker", "profiler")
"""How :func:`measure_memory` measures peak bytes (see :class:`MemoryMeasurement`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryReport:
    """What one forward + backward allocated, in bytes (``None``: not measured).

    Attributes:
        saved_bytes: storages saved for backward during forward (each once, parameters left out).
        saved_float_bytes: the floating-point part of ``saved_bytes`` (activations, weights).
        saved_index_bytes: the integer/bool part of ``saved_bytes`` (routing index arrays).
        peak_bytes: largest live bytes at once, above what was alive at entry.
        forward_peak_bytes: the peak during forward.
        backward_peak_bytes: the peak after ``end_forward`` (backward), same baseline.
        after_forward_bytes: bytes created in forward and still alive at its end (saved
            activations, outputs, tensors a checkpoint keeps).
        retained_bytes: bytes created in the region and alive at exit (e.g. new ``.grad``).
        baseline_bytes: bytes allocated at entry (CUDA allocator); ``None`` on the CPU.
    """

    saved_bytes: int | None = None
    saved_float_bytes: int | None = None
    saved_index_bytes: int | None = None
    peak_bytes: int | None = None
    forward_peak_bytes: int | None = None
    backward_peak_bytes: int | None = None
    after_forward_bytes: int | None = None
    retained_bytes: int | None = None
    baseline_bytes: int | None = None

    def to_dict(self) -> dict[str, int | None]:
        """Field name → bytes (or ``None``), JSON-ready."""
        return {name: getattr(self, name) for name in self.__slots__}


class MemoryMeasurement:
    """Handle of :func:`measure_memory`: call ``end_forward()`` between forward and backward.

    Args:
        device: device whose memory is measured (``cpu`` storage tracker, or CUDA statistics).
        exclude: tensors whose storages the saved-bytes count leaves out (parameters are always
            left out).
        peak: ``tracker`` (live storage tracker on the CPU, allocator statistics on CUDA) or
            ``profiler`` (``torch.profiler``'s allocator events, CPU ground truth; see
            :mod:`memfine.measure.profiled`).

    Raises:
        ValueError: for another ``peak`` value, or ``profiler`` on a CUDA device.
    """

    def __init__(self, device: str | torch.device, exclude: Iterable[torch.Tensor],
                 peak: str = "tracker") -> None:
        """Create the (unentered) peak and saved-tensor trackers; arguments as on the class."""
        if peak not in PEAK_METHODS:
            raise ValueError(f"peak must be one of {PEAK_METHODS}, got {peak!r}")
        if peak == "profiler" and torch.device(device).type == "cuda":
            raise ValueError("peak='profiler' measures the CPU allocator; use 'tracker' on CUDA")
        self.peak: PeakMemoryTracker | ProfiledPeakMemory = (
            PeakMemoryTracker(device) if peak == "tracker" else ProfiledPeakMemory())
        self.saved = SavedTensorsTracker(exclude)
        self._saved_open = False
        self._forward_ended = False

    def end_forward(self) -> None:
        """Stop counting saved tensors and close the forward phase of the peak tracker.

        Raises:
            RuntimeError: when called twice.
        """
        if self._forward_ended:
            raise RuntimeError("MemoryMeasurement.end_forward was already called")
        self._forward_ended = True
        if self._saved_open:
            self.saved.__exit__(None, None, None)
            self._saved_open = False
        self.peak.mark("forward")

    def report(self) -> MemoryReport:
        """The :class:`MemoryReport` (call after the ``with`` block)."""
        items = self.saved.items
        float_bytes = sum(i.nbytes for i in items if i.dtype.is_floating_point)
        fwd = self.peak.phase_peaks.get("forward") if self._forward_ended else None
        return MemoryReport(
            saved_bytes=self.saved.total_bytes,
            saved_float_bytes=float_bytes,
            saved_index_bytes=self.saved.total_bytes - float_bytes,
            peak_bytes=self.peak.peak_bytes,
            forward_peak_bytes=fwd,
            backward_peak_bytes=self.peak.phase_peaks.get("end") if self._forward_ended else None,
            after_forward_bytes=self.peak.marks.get("forward"),
            retained_bytes=self.peak.current_bytes,
            baseline_bytes=self.peak.baseline_bytes,
        )


@contextmanager
def measure_memory(device: str | torch.device = "cpu", *, exclude: Iterable[torch.Tensor] = (),
                   peak: str = "tracker") -> Iterator[MemoryMeasurement]:
    """Measure saved and peak bytes of the code in the ``with`` block.

    Example:
        >>> with measure_memory(exclude=layer.parameters()) as m:
        ...     out, aux = layer(x)
        ...     m.end_forward()
        ...     out.backward(grad_out)
        >>> m.report().peak_bytes

    Args:
        device: ``cpu`` (storage tracker) or a CUDA device (allocator statistics).
        exclude: tensors left out of the saved-bytes count (parameters are always left out).
        peak: ``tracker`` or ``profiler`` (see :class:`MemoryMeasurement`).

    Yields:
        A :class:`MemoryMeasurement`; saved tensors are counted until ``end_forward()`` (or the
        end of the block), so tensors saved by recomputation in backward are not counted.
    """
    m = MemoryMeasurement(device, exclude, peak)
    with m.peak:
        m.saved.__enter__()
        m._saved_open = True
        try:
            yield m
        finally:
            if m._saved_open:
                m.saved.__exit__(None, None, None)
                m._saved_open = False


def measure_backward(forward: Callable[[], Sequence[torch.Tensor]],
                     grad_outputs: Sequence[torch.Tensor | None], *,
                     device: str | torch.device = "cpu",
                     exclude: Iterable[torch.Tensor] = (), peak: str = "tracker") -> MemoryReport:
    """Measure ``forward()`` then ``torch.autograd.backward(outputs, grad_outputs)``.

    The protocol of the memory model's validation: the gradients of the outputs exist before the
    region (as the gradient arriving from the next layer does), forward's outputs stay alive
    until the end (the next layer holds them).

    Args:
        forward: returns the tensors to back-propagate from.
        grad_outputs: one gradient per output (``None`` for a scalar output: a gradient of 1).
        device: as :func:`measure_memory`.
        exclude: tensors left out of the saved-bytes count.
        peak: ``tracker`` or ``profiler`` (see :class:`MemoryMeasurement`).

    Returns:
        The :class:`MemoryReport`.
    """
    with measure_memory(device, exclude=exclude, peak=peak) as m:
        outputs = forward()
        m.end_forward()
        torch.autograd.backward(list(outputs), list(grad_outputs))
    return m.report()


@dataclass(frozen=True, kw_only=True, slots=True)
class ComparisonRow:
    """One item, predicted next to measured.

    Attributes:
        name: the item (e.g. ``saved``, ``peak``).
        predicted_bytes: model value.
        measured_bytes: measured value, or ``None`` when not measured.
    """

    name: str
    predicted_bytes: int
    measured_bytes: int | None

    @property
    def ratio(self) -> float | None:
        """Ratio predicted / measured bytes (``None`` when not measured or measured is 0)."""
        if not self.measured_bytes:
            return None
        return self.predicted_bytes / self.measured_bytes


def compare(predicted: Mapping[str, int], measured: Mapping[str, int | None]
            ) -> list[ComparisonRow]:
    """Rows of predicted vs measured bytes, in the order of ``predicted``.

    Args:
        predicted: item → predicted bytes.
        measured: item → measured bytes (missing or ``None``: not measured).

    Returns:
        One :class:`ComparisonRow` per predicted item.
    """
    return [ComparisonRow(name=k, predicted_bytes=v, measured_bytes=measured.get(k))
            for k, v in predicted.items()]


def format_table(rows: Iterable[ComparisonRow]) -> str:
    """Plain-text table: item, predicted bytes, measured bytes, ratio, and the MiB form."""
    lines = [f"{'item':<24} {'predicted bytes':>16} {'measured bytes':>16} {'ratio':>8} "
             f"{'predicted':>14}"]
    for r in rows:
        measured = NOT_MEASURED if r.measured_bytes is None else str(r.measured_bytes)
        ratio = "-" if r.ratio is None else f"{r.ratio:.4f}"
        lines.append(f"{r.name:<24} {r.predicted_bytes:>16} {measured:>16} {ratio:>8} "
                     f"{format_bytes(r.predicted_bytes, digits=3):>14}")
    return "\n".join(lines)
