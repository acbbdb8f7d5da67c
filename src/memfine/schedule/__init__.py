"""Scheduling of the MoE expert part: memory model, chunk planner (MACT), chunked execution.

Reference: MemFine (arXiv 2511.21431) §4, Eq. 8-9; DESIGN.md §4.
"""

from memfine.schedule.chunked import chunk_sizes, chunked_experts, run_chunked
from memfine.schedule.planner import choose_num_chunks, parse_bytes, s_prime_max
from memfine.schedule.policy import AgreeNumChunks, ChunkPolicy, identity_agreement

__all__ = [
    "AgreeNumChunks",
    "ChunkPolicy",
    "choose_num_chunks",
    "chunk_sizes",
    "chunked_experts",
    "identity_agreement",
    "parse_bytes",
    "run_chunked",
    "s_prime_max",
]
