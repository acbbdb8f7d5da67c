"""The training loop's parallel engine under torchrun: DeviceMesh + FSDP2 + expert parallelism.

``memfine train`` under ``torchrun`` builds a :class:`DistributedTraining` and hands it to
:func:`memfine.train.train` (it implements :class:`memfine.train.parallel.ParallelTraining`).
Every rank builds the same model from the same seed, shards it (:func:`shard_model`) and trains
on its own rows of each global batch: a run equals the one-process run up to summation order.
Reference: docs/design.md §4, §6; torchtitan's training loop (FSDP2, DCP).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from memfine.parallel.collectives import collective_device
from memfine.parallel.fsdp import clip_grad_norm_, shard_model
from memfine.parallel.mesh import (
    DEFAULT_TIMEOUT_S,
    ParallelContext,
    check_layout,
    init_parallel,
)


class DistributedTraining:
    """Hooks of the training loop over a (dp_shard, ep) mesh.

    Args:
        context: this rank's :class:`ParallelContext`.

    Attributes:
        context: as given.
        is_main: True on global rank 0 (writes metrics, reports, checkpoint metadata).
        sharded: always True (checkpoints through torch.distributed.checkpoint).
    """

    sharded = True

    def __init__(self, context: ParallelContext) -> None:
        """Keep ``context``; arguments as on the class."""
        self.context = context
        self.is_main = context.rank == 0

    @classmethod
    def from_environment(cls, *, dp_shard: int, ep: int, backend: str | None = None,
                         device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
                         ) -> DistributedTraining:
        """Join the ``torchrun`` job and build the mesh.

        Args:
            dp_shard: size of the ``dp_shard`` dim.
            ep: size of the ``ep`` dim.
            backend: ``gloo`` or ``nccl``; default gloo on CPU, nccl on CUDA.
            device: the run's device (``cuda`` uses ``cuda:LOCAL_RANK``).
            timeout_s: collective timeout, seconds.

        Raises:
            ValueError: if the job was not launched by torchrun (no ``WORLD_SIZE``), the world
                size is not dp_shard × ep, or the backend does not fit the device — before any
                process group is created.
        """
        if "WORLD_SIZE" not in os.environ:
            raise ValueError("--dp-shard/--ep need a torchrun launch, e.g. torchrun "
                             "--nproc_per_node 2 -m memfine train --ep 2")
        check_layout(int(os.environ["WORLD_SIZE"]), dp_shard, ep)
        cuda = device.startswith("cuda")
        backend = backend or ("nccl" if cuda else "gloo")
        if backend == "nccl" and not cuda:
            raise ValueError(f"--backend nccl needs --device cuda, got --device {device}")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return cls(init_parallel(dp_shard, ep, backend=backend, timeout_s=timeout_s))

    def check(self, *, num_experts: int, batch_size: int) -> None:
        """Validate sizes before any work.

        Raises:
            ValueError: if E % ep != 0 or the global batch does not split over the W ranks.
        """
        self.context.local_experts(num_experts)
        if batch_size % self.context.world_size:
            raise ValueError(f"TrainConfig.batch_size={batch_size} must be divisible by the "
                             f"number of ranks {self.context.world_size} (each rank takes "
                             f"batch_size/ranks sequences of every global batch)")

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Experts over ``ep`` and FSDP2 over the data dims (:func:`shard_model`)."""
        shard_model(model, self.context)

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's contiguous rows (B/W of them) of each (B, ...) tensor of the global batch."""
        W, r = self.context.world_size, self.context.rank
        return tuple(t[r * (t.shape[0] // W):(r + 1) * (t.shape[0] // W)] for t in tensors)

    def set_gradient_sync(self, model: torch.nn.Module, enabled: bool) -> None:
        """FSDP2's ``set_requires_gradient_sync`` on the model and every FSDP submodule."""
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled, recurse=True)

    def clip_grad_norm_(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Global-norm clipping of DTensor gradients (:func:`memfine.parallel.clip_grad_norm_`)."""
        return clip_grad_norm_(params, max_norm)

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().to(collective_device(None), copy=True)
        dist.all_reduce(out)
        return out

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over all ranks of a detached tensor (for logging; a collective)."""
        return (self._all_reduce(value) / self.context.world_size).to(value.device)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over all ranks of a detached tensor (e.g. tokens per expert; a collective)."""
        return self._all_reduce(value).to(value.device)

    def barrier(self) -> None:
        """``torch.distributed.barrier`` over the world."""
        dist.barrier()

    def close(self, *, barrier: bool = False) -> None:
        """Leave the process group.

        Args:
            barrier: wait for every rank first (after a successful run, so no rank tears the
                group down while another still finishes its last collective). Leave it False
                after an error on this rank: the other ranks may be gone.
        """
        if dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
