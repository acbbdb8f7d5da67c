"""The argparse ``type`` of each kind of flag value: int64, float, int list, path, text, bytes.

Each raises ``argparse.ArgumentTypeError`` (or ``ValueError``) in one line, which argparse
prefixes with the flag's name; :func:`check_device` refuses a device this machine lacks.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from memfine.units import INT64_MAX, parse_bytes

INT64_MIN = -INT64_MAX - 1


def int64(text: str) -> int:
    """An argparse ``type`` for an int flag: an integer within int64, what torch can hold.

    Python ints are unbounded: ``--seed 10**23`` would fail deep inside torch; ``1e23`` is no
    integer.

    Raises:
        argparse.ArgumentTypeError: on a non-integer or a value outside int64 (argparse names
            the flag).
    """
    try:
        got = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not INT64_MIN <= got <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**63 - 1] (int64), "
                                         f"got {text}")
    return got


int64.__name__ = "int"  # argparse's "invalid int value" if it ever shows


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an int flag with a lower bound (``--repeats``, ``--threads``).

    Args:
        low: the smallest value allowed.

    Returns:
        The converter: an :func:`int64` integer ``>= low``, else ``argparse.ArgumentTypeError``.
    """
    def convert(text: str) -> int:
        got = int64(text)
        if got < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text}")
        return got

    convert.__name__ = "int"
    return convert


def finite_float(text: str) -> float:
    """An argparse ``type`` for a float flag: a finite number (no ``inf`` or ``nan``).

    Raises:
        argparse.ArgumentTypeError: on a non-number, an infinity or a NaN (argparse names the
            flag).
    """
    try:
        got = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(got):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return got


finite_float.__name__ = "float"


def comma_ints(text: str) -> tuple[int, ...]:
    """Parse ``"1,2,4,8"`` into ``(1, 2, 4, 8)`` (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: when an item is not an int (argparse names the flag).
    """
    try:
        items = [int(item) for item in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 1,2,4,8, got "
                                         f"{text!r}") from None
    return tuple(int64(str(item)) for item in items)


def path_flag(text: str) -> Path:
    """An argparse ``type`` for a directory flag (``--out``, ``--init-from``).

    An empty value is refused: ``Path("")`` is the current directory, so ``--out ""`` (an
    unset shell variable) would scatter a run's files there. A leading ``~`` is the home
    directory, as in the shell, which does not expand it in ``--out=~/runs/x``.

    Raises:
        argparse.ArgumentTypeError: on an empty or blank value (argparse names the flag).
    """
    return Path(_not_blank(text, "a path", " (for the current directory give '.')")).expanduser()


def file_flag(what: str) -> Callable[[str], Path]:
    """An argparse ``type`` for a flag that names one file (``--config``, ``--to``).

    As :func:`path_flag`, but an empty value's message says which file the flag takes.

    Args:
        what: the file, for the message (``"a TOML file of flag values"``).

    Returns:
        The converter; ``argparse.ArgumentTypeError`` on an empty or blank value or a folder.
    """
    def convert(text: str) -> Path:
        if str(text).endswith(("/", os.sep)):  # a folder (``Path`` would drop the separator)
            raise argparse.ArgumentTypeError(f"expected the path of {what}, got {text!r}: a folder")
        return Path(_not_blank(text, f"the path of {what}")).expanduser()

    convert.__name__ = "path"
    return convert


def _not_blank(text: str, expected: str, hint: str = "") -> str:
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}{hint}")
    return str(text)


def text_flag(text: str) -> str:
    """An argparse ``type`` for a text flag that names something (``--data``): not blank.

    An empty value (an unset shell variable) must not fall back to a default or, read as a
    path, to the current directory.

    Raises:
        argparse.ArgumentTypeError: on an empty or blank value (argparse names the flag).
    """
    return _not_blank(text, "a value")


def byte_size(keyword: str | None = None) -> Callable[[str], int | None]:
    """An argparse ``type`` for a byte size that names its unit (``512MiB``, ``80GiB``, ``80GB``).

    A bare number is refused (:func:`memfine.units.parse_bytes` with ``require_unit``): on a
    command line it is meant as MiB or GiB, and reading it as bytes would be a silent wrong
    answer.

    Args:
        keyword: a word that stands for None (``"none"``, ``"auto"``; case-insensitive), or None
            when every value must be a size.

    Returns:
        The converter: bytes (int > 0), or None for ``keyword``; else ``ArgumentTypeError``.
    """
    def convert(text: str) -> int | None:
        if keyword is not None and str(text).strip().lower() == keyword:
            return None
        try:
            size = parse_bytes(text, require_unit=True)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if size > INT64_MAX:  # what torch and the configs' integer fields can hold
            raise argparse.ArgumentTypeError(f"{text!r} is {size} bytes, above the largest "
                                             f"size {INT64_MAX} (2**63 - 1)")
        return size

    convert.__name__ = "byte size"  # argparse's "invalid <name> value" if it ever shows
    return convert


def check_device(device: str, flag: str = "--device") -> str:
    """Refuse a torch device this machine cannot run before anything is loaded or written.

    Returns:
        ``device`` unchanged.

    Raises:
        ValueError: naming the flag when ``device`` is not a torch device string, or asks for
            CUDA where this torch has no CUDA device.
    """
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {device!r} is not a torch device; use cpu or cuda[:i]"
                         ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device} needs CUDA, and this torch has no CUDA device "
                         f"(torch {torch.__version__}); use {flag} cpu")
    return device
