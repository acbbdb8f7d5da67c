"""What a training loop needs to run under expert parallelism, in one object.

``memfine train --ep e`` (under ``torchrun``) builds an :class:`ExpertParallelTraining` and hands
it to :func:`memfine.train.train`, which calls it at a few points: after building the model
(shard the experts), per step (take this rank's rows of the global batch; reduce and clip the
gradients; average the logged values), and for checkpoints (full, gathered tensors, written by
rank 0; loaded at any EP size). Every rank builds the same model from the same seed and draws the
same global batch, so a run equals the single-process run on that batch up to summation order.
Reference: docs/design.md §4, §6.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from memfine.parallel.collectives import collective_device
from memfine.parallel.grads import clip_grad_norm, sync_gradients
from memfine.parallel.groups import DEFAULT_TIMEOUT_S, ParallelContext, init_parallel
from memfine.parallel.state import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    shard_moe_layers,
)


class StateView:
    """Exposes ``state_dict()`` for an already gathered state (for checkpoint writers)."""

    def __init__(self, state: dict[str, Any]) -> None:
        """Wrap ``state`` (kept by reference, not copied)."""
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        """The gathered state."""
        return self._state


class ExpertParallelTraining:
    """Hooks of the training loop under EP (with data parallelism over W/e EP groups).

    Args:
        context: this rank's :class:`ParallelContext`.

    Attributes:
        context: as given.
        is_main: True on global rank 0 (writes metrics, checkpoints and reports).
    """

    def __init__(self, context: ParallelContext) -> None:
        """Keep ``context``; arguments as on the class."""
        self.context = context
        self.is_main = context.rank == 0

    @classmethod
    def from_environment(cls, ep_size: int, *, device: str = "cpu",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> ExpertParallelTraining:
        """Join the ``torchrun`` job: gloo on CPU, nccl on CUDA (device ``cuda:LOCAL_RANK``).

        Raises:
            ValueError: if the job was not launched by torchrun (no ``WORLD_SIZE``) or ``ep_size``
                does not divide the world size.
        """
        if "WORLD_SIZE" not in os.environ:
            raise ValueError("--ep needs a torchrun launch, e.g. torchrun --nproc_per_node 2 -m "
                             "memfine train --ep 2")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(init_parallel(ep_size, backend=backend, timeout_s=timeout_s))

    def check(self, *, num_experts: int, batch_size: int) -> None:
        """Validate sizes before any work.

        Raises:
            ValueError: if E % e != 0 or the global batch does not split over the W ranks.
        """
        self.context.local_experts(num_experts)
        if batch_size % self.context.world_size:
            raise ValueError(f"TrainConfig.batch_size={batch_size} must be divisible by the "
                             f"number of ranks {self.context.world_size} (each rank takes "
                             f"batch_size/ranks sequences of every global batch)")

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Keep this rank's experts of every MoE layer; install the EP path and agreement."""
        shard_moe_layers(model, self.context)

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's contiguous rows (B/W of them) of each (B, ...) tensor of the global batch."""
        W, r = self.context.world_size, self.context.rank
        return tuple(t[r * (t.shape[0] // W):(r + 1) * (t.shape[0] // W)] for t in tensors)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Gradients of the global mean loss (see :func:`sync_gradients`)."""
        sync_gradients(model.parameters(), self.context)

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        """Global-norm clipping with ``torch.nn.utils.clip_grad_norm_``'s signature."""
        return clip_grad_norm(params, max_norm, self.context)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over all ranks of a detached tensor (for logging; a collective)."""
        out = value.detach().to(collective_device(None), copy=True)
        dist.all_reduce(out)
        return (out / self.context.world_size).to(value.device)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over all ranks of a detached tensor (e.g. tokens per expert; a collective)."""
        out = value.detach().to(collective_device(None), copy=True)
        dist.all_reduce(out)
        return out.to(value.device)

    def full_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[StateView, StateView]:
        """Gathered model and optimizer states (a collective: call on every rank)."""
        return (StateView(full_state_dict(model, self.context)),
                StateView(full_optimizer_state_dict(model, optimizer, self.context)))

    def load_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Load full (any EP size) model and optimizer states into this rank's shards."""
        load_full_state_dict(model, model_state, self.context)
        load_full_optimizer_state_dict(model, optimizer, optimizer_state, self.context)

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
