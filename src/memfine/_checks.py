"""Validators shared by the frozen configs, and checks on tensor values.

Each config validator raises ValueError naming the field, the allowed values and the value
received (e.g. ``MoEConfig.top_k must be in [1, 8], got 9``).

:func:`check_tensor` checks data (an expert id repeated within a token, a token id out of range)
without breaking a ``torch.compile`` graph: in eager mode it reads the values (one host sync) and
raises ``ValueError``; while ``torch.compile`` traces, a host read would end the graph, so the
check is emitted as ``torch._assert_async`` instead (the compiled code raises ``RuntimeError``
with the same message when the condition is False).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar, get_args

import torch

_V = TypeVar("_V")


class FieldError(ValueError):
    """An invalid config field: ``<Class>.<field> must be <allowed>, got <value>``.

    A ``ValueError`` that keeps its parts, so a command line can name the flag that set the
    field instead of the class (``--lr must be > 0, got -0.001``).

    Attributes:
        owner: the config class's name, e.g. ``"TrainConfig"``.
        field: the field's name, e.g. ``"lr"``.
        allowed: what the field allows, in the library's words (``"in (0.0, inf)"``).
        value: the value received.
        plain: what is allowed as a person types it (no ``None``, no ``inf``), e.g. ``"> 0"``;
            ``allowed`` when the two read alike.
    """

    def __init__(self, owner: str, field: str, allowed: str, value: object,
                 plain: str | None = None) -> None:
        """Keep the parts; the message is ``<owner>.<field> must be <allowed>, got <value!r>``."""
        super().__init__(f"{owner}.{field} must be {allowed}, got {value!r}")
        self.owner, self.field, self.allowed, self.value = owner, field, allowed, value
        self.plain = allowed if plain is None else plain


def fail(obj: object, name: str, allowed: str, value: object,
         plain: str | None = None) -> NoReturn:
    """Raise :class:`FieldError` ``"<Class>.<name> must be <allowed>, got <value>"``.

    ``plain``: what is allowed as typed on a command line (see :class:`FieldError`).
    """
    raise FieldError(type(obj).__name__, name, allowed, value, plain)


def check_int(obj: object, name: str, lo: int, hi: int | None = None) -> None:
    """Check that ``obj.<name>`` is an int (not a bool) in ``[lo, hi]`` (``hi=None``: no bound)."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        fail(obj, name, "an int" + (" of bytes (memfine.units.parse_bytes turns '16MiB' into "
                                    "one)" if name.endswith("_bytes") else ""), value)
    if value < lo or (hi is not None and value > hi):
        fail(obj, name, f"in [{lo}, {hi}]" if hi is not None else f">= {lo}", value)


def check_float(obj: object, name: str, lo: float, hi: float | None = None, *,
                lo_open: bool = False) -> None:
    """Check that ``obj.<name>`` is a finite number in [lo, hi] (open at lo if ``lo_open``)."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        fail(obj, name, "a finite number", value)
    bad_lo = value <= lo if lo_open else value < lo
    if bad_lo or (hi is not None and value > hi) or value == float("inf"):
        left = "(" if lo_open else "["
        right = "inf)" if hi is None else f"{hi}]"  # a finite upper bound is inclusive
        plain = None if hi is not None else (
            "a finite number" if value == float("inf") else f"{'>' if lo_open else '>='} {lo:g}")
        fail(obj, name, f"in {left}{lo}, {right}", value, plain)


def check_choice(obj: object, name: str, literal: Any) -> None:
    """``literal`` is a ``Literal`` type or a tuple of the allowed values."""
    value = getattr(obj, name)
    allowed = literal if isinstance(literal, tuple) else get_args(literal)
    if value not in allowed:
        fail(obj, name, f"one of {allowed}", value)


def lookup(table: Mapping[str, _V], name: str, what: str) -> _V:
    """``table[name]``; an unknown name raises ValueError naming ``what`` and the known names."""
    if name not in table:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {name!r}")
    return table[name]


def check_bins(obj: object, name: str = "bins", hi: int | None = None) -> tuple[int, ...]:
    """Check chunk-count bins (non-empty, strictly increasing ints in [1, hi]); return a tuple."""
    value = getattr(obj, name)
    bins = tuple(value) if isinstance(value, (tuple, list)) else ()
    if (not bins or any(isinstance(b, bool) or not isinstance(b, int) for b in bins)
            or bins[0] < 1 or any(a >= b for a, b in zip(bins, bins[1:], strict=False))
            or (hi is not None and bins[-1] > hi)):
        bound = ">= 1" if hi is None else f"in [1, {hi}]"
        fail(obj, name, f"a non-empty, strictly increasing tuple of ints {bound}", value,
             f"strictly increasing ints {bound}")
    return bins


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
