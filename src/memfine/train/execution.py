"""How the training step runs: eagerly or under ``torch.compile``, in fp32/bf16 or under autocast.

``memfine train --compile`` compiles the model's forward (inductor, the default backend);
autograd then runs the compiled backward. ``torch._dynamo.config.capture_scalar_outputs`` is on
while the compiled forward runs, so the routing index's data-dependent row count S stays in the
graph (an unbacked size) instead of ending it (docs/compile.md). Evaluation and text sampling call
the eager model (sampling feeds ever longer windows, each a new shape).

``memfine train --autocast bfloat16`` runs the forward and the loss under
``torch.autocast(device, dtype=torch.bfloat16)``: the parameters (master weights), their
gradients and the optimizer state stay fp32; matmuls run in bf16; the router stays fp32
(:func:`memfine.routing.precision.fp32_routing`) and the experts save bf16 x and H
(:func:`memfine.ops.autocast_operands`). ``--dtype bfloat16`` instead stores bf16 weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfine.config import TrainConfig


def step_forward(model: nn.Module, config: TrainConfig) -> Callable[..., Any]:
    """The callable the training step uses for the forward: the model, or its compiled form.

    Args:
        model: the model (its parameters and state dict are shared with the compiled form).
        config: the run; ``config.compile`` selects ``torch.compile(model)``.

    Returns:
        ``forward(*args, **kwargs)`` returning what ``model(*args, **kwargs)`` returns.
    """
    if not config.compile:
        return model
    compiled = torch.compile(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return compiled(*args, **kwargs)

    return forward


def autocast_region(device: torch.device, config: TrainConfig
                    ) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``config.autocast`` (bf16), or a context that does nothing.

    Args:
        device: the run's device (its type selects the autocast backend).
        config: the run; ``config.autocast`` is ``none`` or ``bfloat16``.

    Returns:
        A context manager for the forward and the loss.
    """
    if config.autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, config.autocast))
