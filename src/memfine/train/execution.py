"""How the training step runs: eagerly or under ``torch.compile``, in fp32/bf16 or under autocast.

``--compile`` compiles the model's forward (inductor) with ``capture_scalar_outputs`` on, so the
routing index's data-dependent row count S stays in the graph (docs/compile.md); evaluation and
sampling stay eager. Under torchrun the expert all-to-alls (data-dependent split sizes) and
FSDP2's per-block hooks cannot be one graph: as in torchtitan, each block's collective-free
regions are compiled instead (:meth:`memfine.nn.MoETransformerLM.compile_regions`).

``--autocast bfloat16`` runs the forward and the loss under ``torch.autocast`` with bf16: fp32
master weights, gradients and optimizer state, bf16 matmuls, an fp32 router
(:func:`memfine.routing.precision.fp32_routing`) and bf16 x and H saved by the experts
(:func:`memfine.experts.autocast_operands`). ``--dtype bfloat16`` instead stores bf16 weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from memfine.config import TrainConfig
from memfine.nn import MoETransformerLM


def step_forward(model: MoETransformerLM, config: TrainConfig, *,
                 sharded: bool = False) -> Callable[..., Any]:
    """The callable the training step uses for the forward: the model, or its compiled form.

    Args:
        model: the model (its parameters and state dict are shared with the compiled form).
        config: the run; ``config.compile`` selects ``torch.compile(model)``, or
            ``model.compile_regions()`` when ``sharded``.
        sharded: the model is sharded over ranks (FSDP2, expert parallelism).

    Returns:
        ``forward(*args, **kwargs)`` returning what ``model(*args, **kwargs)`` returns.
    """
    if not config.compile:
        return model
    compiled = model.compile_regions() if sharded else torch.compile(model)

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
