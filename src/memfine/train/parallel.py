"""The parallel part of the training loop, as a typed contract.

Legend: B batch.

The loop calls a :class:`ParallelTraining` to shard the model, take this rank's rows of each
global batch, switch gradient synchronisation off while accumulating, clip by the global norm,
combine logged values and write checkpoints (``sharded``: through torch.distributed.checkpoint).
:class:`SingleProcess` is the default; ``memfine.parallel.DistributedTraining`` the DeviceMesh +
FSDP2 one (``memfine train`` under torchrun). The loop never branches on which one it has.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ParallelTraining(Protocol):
    """What the training loop needs from a parallel engine.

    Attributes:
        is_main: True on the process that writes the run's files (metrics, reports, the
            checkpoint's metadata).
        sharded: True when parameters are sharded over ranks (checkpoints then go through
            torch.distributed.checkpoint, written by every rank); False on one process (one
            ``checkpoint.pt`` file).
    """

    is_main: bool
    sharded: bool

    def check(self, *, num_experts: int, batch_size: int) -> None:
        """Raise ValueError when E or the global batch does not split over the ranks."""

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Shard or wrap ``model`` in place, before the optimizer is built."""

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows of each (B, ...) tensor of the global batch."""

    def set_gradient_sync(self, model: torch.nn.Module, enabled: bool) -> None:
        """Whether the next backward reduces gradients over the ranks (off while accumulating)."""

    def clip_grad_norm_(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm; returns the norm before clipping (a 0-d tensor)."""

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a detached tensor over the ranks (for logging)."""

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a detached tensor over the ranks (e.g. tokens per expert)."""

    def barrier(self) -> None:
        """Wait for every rank (around checkpoint writes)."""


class SingleProcess:
    """:class:`ParallelTraining` for one process: every hook is the identity or plain torch.

    Attributes:
        is_main: always True.
        sharded: always False.
    """

    is_main = True
    sharded = False

    def check(self, *, num_experts: int, batch_size: int) -> None:
        """Nothing to check on one process."""

    def prepare_model(self, model: torch.nn.Module) -> None:
        """The model stays whole."""

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The whole batch."""
        return tensors

    def set_gradient_sync(self, model: torch.nn.Module, enabled: bool) -> None:
        """Nothing to synchronise."""

    def clip_grad_norm_(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself."""
        return value

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself."""
        return value

    def barrier(self) -> None:
        """Nothing to wait for."""
