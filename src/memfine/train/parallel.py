"""The parallel part of the training loop, as a typed contract.

Legend: B batch.

:func:`memfine.train.train` calls a :class:`ParallelTraining` at a few points: after building the
model (shard it), per step (take this rank's rows of the global batch; reduce and clip the
gradients; combine logged values over the ranks) and for checkpoints (full states in, full states
out). :class:`SingleProcess` is the one-process implementation the loop uses by default;
``memfine.parallel.ExpertParallelTraining`` is the expert-parallel one (``memfine train --ep``).
The loop never branches on which one it has.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ParallelTraining(Protocol):
    """What the training loop needs from a parallel engine.

    Attributes:
        is_main: True on the process that writes files (metrics, checkpoints, reports).
    """

    is_main: bool

    def check(self, *, num_experts: int, batch_size: int) -> None:
        """Raise ValueError when E or the global batch does not split over the ranks."""

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Shard or wrap ``model`` in place, before the optimizer is built."""

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows of each (B, ...) tensor of the global batch."""

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Turn local gradients into gradients of the global mean loss (a collective)."""

    def clip_grad_norm_(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm; returns the norm before clipping (a 0-d tensor)."""

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a detached tensor over the ranks (for logging)."""

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a detached tensor over the ranks (e.g. tokens per expert)."""

    def full_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[Any, Any]:
        """Objects whose ``state_dict()`` are the full model and optimizer states."""

    def load_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Load full states (as :meth:`full_states` writes them) into this rank's parts."""


class SingleProcess:
    """:class:`ParallelTraining` for one process: every hook is the identity or plain torch.

    Attributes:
        is_main: always True.
    """

    is_main = True

    def check(self, *, num_experts: int, batch_size: int) -> None:
        """Nothing to check on one process."""

    def prepare_model(self, model: torch.nn.Module) -> None:
        """The model stays whole."""

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The whole batch."""
        return tensors

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Local gradients are already global."""

    def clip_grad_norm_(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself."""
        return value

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself."""
        return value

    def full_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[Any, Any]:
        """``(model, optimizer)``: their state dicts are already full."""
        return model, optimizer

    def load_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """``load_state_dict`` on both."""
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
