"""Expert parallelism over torch.distributed: count exchange, all-to-all, chunk agreement.

Experts are sharded E/e per rank of an EP group; each layer call exchanges counts, dispatches the
routed rows with uneven all-to-alls, runs the local experts with memfine's fused path and combines
per token. The chunk count is agreed (maximum) over the EP group. Around EP, data parallelism
reduces gradients with explicit all-reduces (grads); checkpoints hold full, gathered expert
tensors (state); :class:`ExpertParallelTraining` bundles what ``memfine train --ep`` needs.
Reference: docs/design.md §4.
"""

from memfine.parallel.collectives import AllToAllFunction, agree_num_chunks, all_to_all
from memfine.parallel.experts import ChunkPolicyLike, ExpertParallelExperts, ep_chunk_forward
from memfine.parallel.grads import clip_grad_norm, is_expert_parameter, sync_gradients
from memfine.parallel.groups import (
    ParallelContext,
    build_context,
    check_expert_sharding,
    default_backend,
    init_parallel,
)
from memfine.parallel.notify import (
    ChunkDispatch,
    ExpertCounts,
    chunk_bounds,
    chunk_expert_counts,
    exchange_counts,
    plan_chunks,
)
from memfine.parallel.rows import RowsFunction, combine_returned_rows, dispatch_rows
from memfine.parallel.state import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    shard_moe_layers,
)
from memfine.parallel.training import ExpertParallelTraining

__all__ = [
    "AllToAllFunction",
    "ChunkDispatch",
    "ChunkPolicyLike",
    "ExpertCounts",
    "ExpertParallelExperts",
    "ExpertParallelTraining",
    "ParallelContext",
    "RowsFunction",
    "agree_num_chunks",
    "all_to_all",
    "build_context",
    "check_expert_sharding",
    "chunk_bounds",
    "chunk_expert_counts",
    "clip_grad_norm",
    "combine_returned_rows",
    "default_backend",
    "dispatch_rows",
    "ep_chunk_forward",
    "exchange_counts",
    "full_optimizer_state_dict",
    "full_state_dict",
    "init_parallel",
    "is_expert_parameter",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "plan_chunks",
    "shard_moe_layers",
    "sync_gradients",
]
