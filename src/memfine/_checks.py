"""Validators shared by the frozen configs.

Each raises ValueError naming the field, the allowed values and the value received
(e.g. ``MoEConfig.top_k must be in [1, 8], got 9``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, get_args

_V = TypeVar("_V")


def fail(obj: object, name: str, allowed: str, value: object) -> None:
    """Raise ``ValueError("<Class>.<name> must be <allowed>, got <value>")``."""
    raise ValueError(f"{type(obj).__name__}.{name} must be {allowed}, got {value!r}")


def check_int(obj: object, name: str, lo: int, hi: int | None = None) -> None:
    """Check that ``obj.<name>`` is an int (not a bool) in ``[lo, hi]`` (``hi=None``: no bound)."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        fail(obj, name, "an int", value)
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
        fail(obj, name, f"in {left}{lo}, {right}", value)


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
        fail(obj, name, f"a non-empty, strictly increasing tuple of ints {bound}", value)
    return bins
