"""Byte units: MiB/GiB, element sizes, and the parse/format of byte counts shown to people.

Units are binary for display (MiB = 2^20, GiB = 2^30); :func:`parse_bytes` also takes decimal
units (MB, GB) as written on device data sheets.
"""

from __future__ import annotations

import re

MiB, GiB = 1 << 20, 1 << 30
NOT_MEASURED = "not measured"


def format_bytes(num_bytes: int | None, *, digits: int = 2, exact: bool = False) -> str:
    """Human form of a byte count: ``"1.50 GiB"`` from 1 GiB on, else ``"12.25 MiB"``.

    Args:
        num_bytes: bytes, or ``None`` for a value that was not measured.
        digits: decimals shown.
        exact: prefix the exact count, ``"<bytes> bytes (<x> MiB)"`` (error messages).

    Returns:
        The string; ``"not measured"`` for ``None``. Units are binary (MiB = 2^20, GiB = 2^30).
    """
    if num_bytes is None:
        return NOT_MEASURED
    unit, scale = ("GiB", GiB) if abs(num_bytes) >= GiB else ("MiB", MiB)
    scaled = f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{num_bytes} bytes ({scaled})" if exact else scaled

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the dtypes the memory model and ``memfine plan`` accept."""

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNIT_NAMES = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (any case)"


def parse_bytes(text: str | int, *, require_unit: bool = False) -> int:
    """Parse a byte size: an int, or a string such as ``"512MiB"``, ``"2GiB"``, ``"64GB"``.

    Args:
        text: the size; a string may carry a unit (B, KiB, MiB, GiB, TiB binary; KB, MB, GB,
            TB decimal; case-insensitive).
        require_unit: refuse a string without a unit (``"80"``): on a command line a bare
            number is usually meant as MiB or GiB, and reading it as bytes would be a silent
            wrong answer. An ``int`` argument is always bytes.

    Returns:
        Bytes as int (> 0).

    Raises:
        ValueError: on an unparsable string, an unknown unit, a missing unit with
            ``require_unit``, or a value ≤ 0.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            bare = "" if require_unit else " or an integer number of bytes"
            raise ValueError(f"byte size must look like '512MiB' or '2GiB'{bare} (units "
                             f"{_UNIT_NAMES}), got {text!r}")
        if float(m.group(1)) <= 0:  # "-5MiB", "0GiB", "-5": the sign is the error, not the unit
            raise ValueError(f"byte size must be > 0, got {text!r}")
        if require_unit and not m.group(2):
            raise ValueError(f"byte size needs a unit, e.g. {m.group(1)}MiB, {m.group(1)}GiB "
                             f"or {m.group(1)}GB, got {text!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"byte size must be > 0, got {text!r}")
    return value


INT64_MAX = 2**63 - 1
"""The largest int64: the largest integer flag value and byte count memfine accepts (what
torch's int64 and the configs' integer fields hold)."""


def checked_byte_size(size: object, name: str) -> int:
    """A byte size given to a Python API: an int number of bytes, or a string with a unit.

    The strings are those of the command line's byte-size flags (``--memory-budget 16GiB``,
    ``"512MiB"``, ``"80GB"``); a string without a unit (``"16"``) is refused rather than read as
    16 bytes, as on the command line.

    Args:
        size: bytes (an ``int``), or a string such as ``"16GiB"``.
        name: the argument's name, for the message (``"memory_budget"``).

    Returns:
        Bytes as int, in [1, 2**63 - 1].

    Raises:
        ValueError: naming ``name``, the value and the allowed forms, on a string without a
            unit or with an unknown one, a value ≤ 0 or above 2**63 - 1, or another type (a
            float, a bool).
    """
    allowed = (f"an int number of bytes or a string with a unit such as '16GiB' or '512MiB' "
               f"(units {_UNIT_NAMES}), > 0 and at most 2**63 - 1 bytes")
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"{name} must be {allowed}, got {size!r}")
    try:
        got = parse_bytes(size, require_unit=True)
    except ValueError:
        raise ValueError(f"{name} must be {allowed}, got {size!r}") from None
    if got > INT64_MAX:
        bytes_ = f" ({got} bytes)" if isinstance(size, str) else ""
        raise ValueError(f"{name} must be {allowed}, got {size!r}{bytes_}")
    return got


def decimal_gb_note(size: int, flag: str) -> str | None:
    """A note for a size given in GB (10^9 bytes) where a GPU's "GB" means GiB, else None.

    A card sold as "80GB" (A100, H100) carries 80 GiB of memory: 85.9e9 bytes, of which
    nvidia-smi shows 81,559 MiB (79.6 GiB) on an H100. ``80GB`` is 74.51 GiB.
    """
    if size % 10**9 or not size % 2**20:
        return None
    return (f"{flag} {size // 10**9}GB is {size:,} bytes = {size / 2**30:.2f} GiB; a card sold "
            "as \"80GB\" (A100, H100) has 80 GiB (85.9e9 bytes; nvidia-smi shows 81,559 MiB = "
            f"79.6 GiB on an H100), so give {flag} 80GiB for it")
