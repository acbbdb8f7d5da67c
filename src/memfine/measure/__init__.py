"""Measure what a forward + backward actually allocated.

Saved-for-backward bytes (saved-tensor hooks) and peak live bytes (a storage tracker on the CPU,
allocator statistics on CUDA, or torch.profiler's allocator events on the CPU).

Reference: docs/design.md §8; docs/style.md §7.
"""

from memfine.measure.peak import PeakMemoryTracker
from memfine.measure.profiled import ProfiledPeakMemory, profiled_peak_bytes
from memfine.measure.report import (
    PEAK_METHODS,
    ComparisonRow,
    MemoryMeasurement,
    MemoryReport,
    compare,
    format_bytes,
    format_table,
    measure_backward,
    measure_memory,
)
from memfine.measure.saved import SavedTensorsTracker, track_saved_tensors

__all__ = [
    "ComparisonRow",
    "MemoryMeasurement",
    "MemoryReport",
    "PEAK_METHODS",
    "PeakMemoryTracker",
    "ProfiledPeakMemory",
    "SavedTensorsTracker",
    "compare",
    "format_bytes",
    "format_table",
    "measure_backward",
    "measure_memory",
    "profiled_peak_bytes",
    "track_saved_tensors",
]
