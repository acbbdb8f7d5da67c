"""Checks on tensor values that raise in eager and do not break a ``torch.compile`` graph.

A check on data (an expert id repeated within a token, a token id out of range) needs the
tensor's values. In eager mode the check reads them (one host sync) and raises ``ValueError``.
While ``torch.compile`` traces, a host read would end the graph (a graph break), so the check is
emitted as ``torch._assert_async`` instead: the compiled code raises ``RuntimeError`` with the
same message when the condition is False.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def check_tensor(cond: torch.Tensor, message: str,
                 detail: Callable[[], str] | None = None) -> None:
    """Raise unless the 0-dim bool tensor ``cond`` is True.

    Args:
        cond: 0-dim bool tensor, on any device.
        message: the error message (naming the argument, what is allowed).
        detail: optional callable adding the offending values to the message in eager mode
            (it may read tensors; it is not called under ``torch.compile``).

    Raises:
        ValueError: in eager mode, when ``cond`` is False (one host sync).
        RuntimeError: from the compiled code (``torch._assert_async``) when ``cond`` is False.
    """
    if torch.compiler.is_compiling():
        torch._assert_async(cond, message)
    elif not bool(cond):
        raise ValueError(message + (detail() if detail is not None else ""))
