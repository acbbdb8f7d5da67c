"""Non-finite weights: which tensors of a model hold NaN or ±inf, and refusing such a checkpoint.

A diverged update leaves NaN or infinite weights; training never saves them
(:mod:`memfine.train.divergence`), and ``memfine generate``, ``eval`` and ``export`` refuse a
checkpoint that holds them (one written before that check, or damaged) with
:func:`check_finite_model` (``memfine train --resume`` too, summing the counts over the ranks)
instead of sampling from NaN
probabilities, writing a NaN model or training on from one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def nonfinite_count(model: torch.nn.Module, total: Callable[[int], int] = int
                    ) -> tuple[int, int, str | None]:
    """How many weight tensors (parameters and buffers) of ``model`` hold NaN or ±inf.

    Args:
        model: the model; a sharded one is checked on this rank's shards.
        total: sums this rank's count over the ranks of a sharded run (a collective);
            default: this process's count.

    Returns:
        ``(non-finite tensors, tensors of this rank, this rank's first non-finite name or None)``.
    """
    state = model.state_dict()
    bad = nonfinite_names(state.items())
    return total(len(bad)), len(state), (bad[0] if bad else None)


def check_finite_model(model: torch.nn.Module, checkpoint: str,
                       total: Callable[[int], int] = int) -> None:
    """Refuse a model whose weights (parameters or buffers) hold NaN or ±inf.

    Args:
        model: the model loaded from ``checkpoint``.
        checkpoint: the checkpoint's path, for the message.
        total: as :func:`nonfinite_count` (a sharded run: every rank calls this).

    Raises:
        ValueError: one line naming the checkpoint, how many tensors are not finite and the
            first of them.
    """
    count, tensors, first = nonfinite_count(model, total)
    if count:
        raise ValueError(nonfinite_message(checkpoint, count, tensors, first))


def nonfinite_message(checkpoint: str, count: int, total: int, first: str | None) -> str:
    """One line: how many of the checkpoint's tensors are not finite, the first, the advice."""
    example = f", e.g. {first}" if first is not None else ""
    return (f"checkpoint {checkpoint!r} holds non-finite weights ({count} of {total} "
            f"tensors{example}): the run that wrote it diverged; train again with a lower --lr "
            f"or --grad-clip")
