"""Process groups for expert parallelism (EP) and data parallelism (DP) around it.

The world of W ranks is cut into W/e EP groups of e consecutive ranks: EP group g holds ranks
[g·e, (g+1)·e). Rank r holds experts [ep_rank·E/e, (ep_rank+1)·E/e) with ep_rank = r mod e. Ranks
that hold the same experts (same ep_rank, one per EP group) form that shard's expert-data-parallel
group; non-expert parameters are replicated on all W ranks.

Every group is created with a timeout, so a rank that never joins a collective ends the run with an
error instead of a hang (gloo raises ``RuntimeError: Timed out waiting ...``).
Reference: docs/design.md §4 (EP all-to-all), §8 (gloo facts).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Where this rank sits in the EP × DP grid, and the groups it talks to.

    Attributes:
        rank: global rank in [0, W).
        world_size: W, all ranks.
        ep_size: e, ranks in one EP group (experts are sharded over them).
        ep_rank: this rank's position in its EP group, in [0, e).
        ep_group: the EP group (dispatch/combine all-to-alls, chunk agreement).
        expert_dp_group: the ranks holding the same expert shard (W/e of them); expert gradients
            are reduced over this group only.
        timeout_s: collective timeout of every group, seconds.
    """

    rank: int
    world_size: int
    ep_size: int
    ep_rank: int
    ep_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup
    timeout_s: float

    @property
    def dp_size(self) -> int:
        """W / e: number of EP groups (data-parallel replicas of each expert shard)."""
        return self.world_size // self.ep_size

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank holds (contiguous).

        Raises:
            ValueError: if ``num_experts`` is not divisible by ``ep_size``.
        """
        check_expert_sharding(num_experts, self.ep_size)
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


def check_expert_sharding(num_experts: int, ep_size: int) -> None:
    """Validate that E experts can be split evenly over e ranks.

    Raises:
        ValueError: if ``ep_size < 1`` or ``num_experts % ep_size != 0``.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"expert-parallel size ep must be an int >= 1, got {ep_size!r}")
    if num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"MoEConfig.num_experts={num_experts} must be divisible by the expert-parallel size "
            f"ep={ep_size} (each rank holds num_experts/ep experts); allowed ep: {divisors}")


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(ep_size: int, *, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Initialise torch.distributed from the environment (``torchrun``) if needed; build groups.

    Args:
        ep_size: e, ranks per EP group; must divide the world size.
        backend: ``gloo`` or ``nccl``; default :func:`default_backend`.
        timeout_s: collective timeout, seconds (> 0).

    Returns:
        The :class:`ParallelContext` of this rank.

    Raises:
        ValueError: on a bad ``ep_size`` or ``timeout_s``.

    Side effects: initialises the default process group (``env://``) when it is not yet
    initialised; creates W/e + e subgroups (a collective call on every rank).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    if not dist.is_initialized():
        dist.init_process_group(backend or default_backend(),
                                timeout=datetime.timedelta(seconds=timeout_s))
    return build_context(ep_size, timeout_s=timeout_s)


def build_context(ep_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Create the EP and expert-DP groups on an initialised default group.

    Every rank must call this with the same arguments (group creation is collective).

    Raises:
        ValueError: if ``ep_size`` does not divide the world size.
        RuntimeError: if torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_parallel() or "
                           "torch.distributed.init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"expert-parallel size ep must divide the world size {world}, "
                         f"got {ep_size!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    ep_group = expert_dp_group = None
    # Group creation is collective: every rank creates every group, in the same order.
    for g in range(world // ep_size):
        ranks = list(range(g * ep_size, (g + 1) * ep_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            ep_group = group
    for j in range(ep_size):
        ranks = list(range(j, world, ep_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            expert_dp_group = group
    assert ep_group is not None and expert_dp_group is not None, "rank missing from its groups"
    return ParallelContext(rank=rank, world_size=world, ep_size=ep_size, ep_rank=rank % ep_size,
                           ep_group=ep_group, expert_dp_group=expert_dp_group,
                           timeout_s=float(timeout_s))
