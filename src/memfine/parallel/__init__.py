"""Scale-out on PyTorch's distributed engine, plus what it lacks: MoE dispatch, chunk agreement.

A (dp_shard, ep) :class:`torch.distributed.device_mesh.DeviceMesh` (mesh); experts sharded E/ep
over ``ep`` as DTensors, each layer exchanging counts, moving rows with uneven all-to-alls and
agreeing on the chunk count with one all-reduce MAX over ``ep`` (experts, notify, rows,
collectives); FSDP2 over the data dims and DTensor-aware norm clipping (fsdp);
:class:`DistributedTraining`, what ``memfine train`` under torchrun needs (training).
Reference: docs/design.md §4.
"""

from memfine.parallel.collectives import AllToAllFunction, agree_num_chunks, all_to_all
from memfine.parallel.experts import ExpertParallelExperts, ep_chunk_forward
from memfine.parallel.fsdp import clip_grad_norm_, shard_model
from memfine.parallel.mesh import (
    MESH_DIMS,
    ParallelContext,
    build_context,
    check_expert_sharding,
    check_layout,
    default_backend,
    init_parallel,
)
from memfine.parallel.notify import (
    ChunkDispatch,
    ExpertCounts,
    chunk_expert_counts,
    exchange_counts,
    plan_chunks,
)
from memfine.parallel.rows import RowsFunction, combine_returned_rows, dispatch_rows
from memfine.parallel.training import DistributedTraining

__all__ = ["MESH_DIMS", "AllToAllFunction", "ChunkDispatch", "DistributedTraining", "ExpertCounts",
           "ExpertParallelExperts", "ParallelContext", "RowsFunction", "agree_num_chunks",
           "all_to_all", "build_context", "check_expert_sharding", "check_layout",
           "chunk_expert_counts", "clip_grad_norm_", "combine_returned_rows", "default_backend",
           "dispatch_rows", "ep_chunk_forward", "exchange_counts", "init_parallel", "plan_chunks",
           "shard_model"]
