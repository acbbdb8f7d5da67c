"""Runtime chunking of the MoE expert part: chunked execution and the MACT chunk-count policy.

Prediction (memory model, Eq. 8-9 planner, presets) lives in :mod:`memfine.memory`.
Reference: MemFine (arXiv 2511.21431) §4, Eq. 8-9; docs/design.md §4.
"""

from memfine.schedule.chunked import chunk_sizes, run_chunked
from memfine.schedule.decision import (
    AgreeNumChunks,
    ChunkDecision,
    ChunkPlan,
    ChunkRows,
    InfeasibleBudgetError,
)
from memfine.schedule.policy import ChunkPolicy

__all__ = [
    "AgreeNumChunks",
    "ChunkDecision",
    "ChunkPlan",
    "ChunkPolicy",
    "ChunkRows",
    "InfeasibleBudgetError",
    "chunk_sizes",
    "run_chunked",
]
