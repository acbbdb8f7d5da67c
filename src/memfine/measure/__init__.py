"""Measure what a forward + backward actually allocated.

Saved-for-backward bytes (saved-tensor hooks) and peak live bytes (a storage tracker on the CPU,
allocator statistics on CUDA, or torch.profiler's allocator events on the CPU). What a GPU would
pay (ATen ops, host syncs, roofline floors) is counted in :mod:`memfine.counts`, whose
:class:`OpCounter` and friends are re-exported here.

Reference: docs/design.md §8; docs/style.md §7.
"""

from memfine.counts.grouped_mm_rules import GroupedMMCall, cuda_grouped_mm_call
from memfine.counts.ops_count import OpCounter, PhaseCounts
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
    "GroupedMMCall",
    "MemoryMeasurement",
    "MemoryReport",
    "OpCounter",
    "PEAK_METHODS",
    "PeakMemoryTracker",
    "PhaseCounts",
    "ProfiledPeakMemory",
    "SavedTensorsTracker",
    "compare",
    "cuda_grouped_mm_call",
    "format_bytes",
    "format_table",
    "measure_backward",
    "measure_memory",
    "profiled_peak_bytes",
    "track_saved_tensors",
]
