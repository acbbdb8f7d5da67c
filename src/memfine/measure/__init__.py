"""Measure what a forward + backward actually allocated.

Saved-for-backward bytes (saved-tensor hooks) and peak live bytes (a storage tracker on the CPU,
allocator statistics on CUDA).

Reference: docs/design.md §8; docs/style.md §7.
"""

from memfine.measure.peak import PeakMemoryTracker
from memfine.measure.report import (
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
    "PeakMemoryTracker",
    "SavedTensorsTracker",
    "compare",
    "format_bytes",
    "format_table",
    "measure_backward",
    "measure_memory",
    "track_saved_tensors",
]
