"""How the training step runs: eagerly or under ``torch.compile``, in fp32/bf16 or under autocast.

``memfine train --compile`` compiles the model's forward (inductor, the default backend);
autograd then runs the compiled backward. ``torch._dynamo.config.capture_scalar_outputs`` is on
while the compiled forward runs, so the routing index's data-dependent row count S stays in the
graph (an unbacked size) instead of ending it (docs/compile.md). Evaluation and text sampling call
the eager model (sampling feeds ever longer windows, each a new shape).

Under torchrun (FSDP2, expert parallelism) the whole forward cannot be one graph: the expert
all-to-alls have data-dependent split sizes and FSDP2's hooks run around every block. As
torchtitan compiles per block, ``--compile`` then compiles the regions of each block that hold no
collective (:func:`compile_regions`: the norms, the attention and the router) in place and leaves
the experts (count exchange, all-to-alls, chunk loop), the aux losses and FSDP2's hooks eager.

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


def step_forward(model: nn.Module, config: TrainConfig, *,
                 sharded: bool = False) -> Callable[..., Any]:
    """The callable the training step uses for the forward: the model, or its compiled form.

    Args:
        model: the model (its parameters and state dict are shared with the compiled form).
        config: the run; ``config.compile`` selects ``torch.compile(model)``, or
            :func:`compile_regions` when ``sharded``.
        sharded: the model is sharded over ranks (FSDP2, expert parallelism).

    Returns:
        ``forward(*args, **kwargs)`` returning what ``model(*args, **kwargs)`` returns.
    """
    if not config.compile:
        return model
    compiled = compile_regions(model) if sharded else torch.compile(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return compiled(*args, **kwargs)

    return forward


def compile_regions(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    """Compile, in place, every block's regions that issue no collective; return ``model``.

    For each block of ``model.blocks``: ``attn_norm``, ``attn``, ``moe_norm`` and
    ``moe.router`` (``nn.Module.compile``, inductor), and the final ``norm``. Left eager: the
    experts (the expert-parallel count exchange, all-to-alls and chunk loop), shared experts,
    the aux losses, the embedding and cross-entropy, and the FSDP2 modules' own hooks (the
    blocks, the experts and the root are FSDP2 modules; none of the compiled regions is).

    Args:
        model: a :class:`memfine.nn.MoETransformerLM`, sharded or not.
        backend: the ``torch.compile`` backend (``inductor``; tests use ``aot_eager``).

    Returns:
        ``model`` itself (its regions now run compiled wherever it is called, evaluation and
        sampling included).
    """
    regions: list[nn.Module] = [model.norm] if isinstance(model.norm, nn.Module) else []
    for block in getattr(model, "blocks", ()):
        regions += [block.attn_norm, block.attn, block.moe_norm, block.moe.router]
    for region in regions:
        region.compile(backend=backend)
    return model


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
