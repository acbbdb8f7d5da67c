"""The device mesh of a distributed run: named dims ``dp_shard`` × ``ep`` over the W ranks.

Rank r sits at (r // ep, r % ep): the ``ep`` dim groups ep consecutive ranks (one expert-parallel
group; experts are sharded E/ep over it and rows move between its ranks by all-to-all); the
``dp_shard`` dim links the ranks holding the same expert shard (the expert-data-parallel dim,
over which FSDP2 shards and reduces the experts). Dense parameters are sharded over all W ranks
(the flattened ``dp`` mesh): the data-parallel degree is W.
Reference: torchtitan's ParallelDims (named mesh dims); docs/design.md §4, §6.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_shard", "ep")
DEFAULT_TIMEOUT_S = 300.0
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Where this rank sits in the (dp_shard, ep) mesh.

    Attributes:
        mesh: the 2-D :class:`DeviceMesh` with dims ``("dp_shard", "ep")``.
        dp_mesh: the same ranks flattened to one dim ``dp`` (size W): dense parameters.
        rank: global rank in [0, W).
        world_size: W = dp_shard · ep.
        dp_shard: size of the ``dp_shard`` dim (replicas of each expert shard).
        ep_size: size of the ``ep`` dim (experts are sharded E/ep over it).
        ep_rank: this rank's coordinate on ``ep``, in [0, ep).
    """

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    rank: int
    world_size: int
    dp_shard: int
    ep_size: int
    ep_rank: int

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The process group of the ``ep`` dim (all-to-alls, the chunk-count agreement)."""
        return self.mesh.get_group("ep")

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The 1-D ``ep`` submesh (expert weights are DTensors sharded over it)."""
        return self.mesh["ep"]

    @property
    def expert_dp_mesh(self) -> DeviceMesh:
        """The 1-D ``dp_shard`` submesh (FSDP2 shards and reduces the experts over it)."""
        return self.mesh["dp_shard"]

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank holds (contiguous).

        Raises:
            ValueError: if ``num_experts`` is not divisible by ``ep_size``.
        """
        check_expert_sharding(num_experts, self.ep_size)
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_layout(world_size: int, dp_shard: int, ep: int) -> None:
    """Validate that the mesh covers the world exactly.

    Raises:
        ValueError: if a size is not an int ≥ 1 or ``dp_shard · ep != world_size``.
    """
    _check_size("--dp-shard", dp_shard)
    _check_size("--ep", ep)
    if dp_shard * ep != world_size:
        raise ValueError(f"the world size {world_size} must equal --dp-shard × --ep, got "
                         f"{dp_shard} × {ep} = {dp_shard * ep}")


def check_expert_sharding(num_experts: int, ep_size: int) -> None:
    """Validate that E experts can be split evenly over ep ranks.

    Raises:
        ValueError: if ``ep_size < 1`` or ``num_experts % ep_size != 0``.
    """
    _check_size("expert-parallel size ep", ep_size)
    if num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"MoEConfig.num_experts={num_experts} must be divisible by the expert-parallel size "
            f"ep={ep_size} (each rank holds num_experts/ep experts); allowed ep: {divisors}")


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def build_context(dp_shard: int, ep: int) -> ParallelContext:
    """Build the (dp_shard, ep) mesh on the initialised default process group.

    Every rank must call this with the same arguments (mesh creation is collective). The mesh's
    device type follows the backend: ``cuda`` under nccl, ``cpu`` under gloo.

    Raises:
        ValueError: if ``dp_shard · ep`` is not the world size.
        RuntimeError: if torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_parallel() or "
                           "torch.distributed.init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    check_layout(world, dp_shard, ep)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp_shard, ep), mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh[MESH_DIMS]._flatten("dp")  # as torchtitan: one dim over all data ranks
    return ParallelContext(mesh=mesh, dp_mesh=dp_mesh, rank=rank, world_size=world,
                           dp_shard=dp_shard, ep_size=ep, ep_rank=mesh.get_local_rank("ep"))


def init_parallel(dp_shard: int, ep: int, *, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Initialise torch.distributed from the environment (``torchrun``) and build the mesh.

    Args:
        dp_shard: size of the ``dp_shard`` dim.
        ep: size of the ``ep`` dim; ``dp_shard · ep`` must be the world size.
        backend: ``gloo`` or ``nccl``; default :func:`default_backend`.
        timeout_s: collective timeout, seconds (> 0): a rank that never joins a collective
            ends the run with an error instead of a hang.

    Under nccl the process's CUDA device is set from ``LOCAL_RANK`` first
    (:func:`set_cuda_device_from_env`).

    Returns:
        The :class:`ParallelContext` of this rank.

    Raises:
        ValueError: on a bad size, backend, timeout or (nccl) ``LOCAL_RANK`` (before any
            process group is created when the world size is known from the environment).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl":
        set_cuda_device_from_env()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return build_context(dp_shard, ep)


def set_cuda_device_from_env() -> int:
    """Make this process's CUDA device the one torchrun assigned it (``LOCAL_RANK``, default 0).

    Under nccl every rank must own one GPU before its first collective; without this all ranks
    of a node would use ``cuda:0``.

    Returns:
        The device index set.

    Raises:
        ValueError: if ``LOCAL_RANK`` is not an int in [0, the visible CUDA devices).
    """
    text = os.environ.get("LOCAL_RANK", "0")
    count = torch.cuda.device_count()
    try:
        local_rank = int(text)
    except ValueError:
        local_rank = -1
    if not 0 <= local_rank < count:
        raise ValueError(f"LOCAL_RANK must be an int in [0, {count}) (the visible CUDA devices) "
                         f"for the nccl backend, got {text!r}")
    torch.cuda.set_device(local_rank)
    return local_rank
