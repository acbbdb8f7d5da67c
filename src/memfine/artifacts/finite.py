"""Non-finite weights: which tensors of a model hold NaN or ±inf, and refusing such a checkpoint.

A diverged update leaves NaN or infinite weights; training never saves them
(:mod:`memfine.train.divergence`), and ``memfine generate``, ``eval`` and ``export`` refuse a
checkpoint that holds them (one written before that check, or damaged) with
:func:`check_finite_model` instead of sampling from NaN probabilities or writing a NaN model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or ±inf value.

    Args:
        named: ``(name, tensor)`` pairs, e.g. ``model.state_dict().items()``; a sharded
            parameter (DTensor) is checked on this rank's shard only.

    Returns:
        The names in the given order (integer and boolean tensors are never listed).
    """
    out = []
    for name, tensor in named:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local.detach()).all()):
            out.append(name)
    return out


def check_finite_model(model: torch.nn.Module, checkpoint: str) -> None:
    """Refuse a model whose weights (parameters or buffers) hold NaN or ±inf.

    Args:
        model: the model loaded from ``checkpoint``.
        checkpoint: the checkpoint's path, for the message.

    Raises:
        ValueError: one line naming the checkpoint, how many tensors are not finite and the
            first of them.
    """
    state = model.state_dict()
    bad = nonfinite_names(state.items())
    if bad:
        raise ValueError(f"checkpoint {checkpoint!r} holds non-finite weights ({len(bad)} of "
                         f"{len(state)} tensors, e.g. {bad[0]}): the run that wrote it diverged; "
                         f"train again with a lower --lr or --grad-clip")
