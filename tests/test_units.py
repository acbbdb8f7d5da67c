"""memfine.units: the int64 limit is defined once and serves byte sizes and integer flags."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import memfine
from memfine import units
from memfine.flags import values

SRC = Path(memfine.__file__).parent


def _module_constants(tree: ast.Module) -> dict[str, int]:
    """Module-level ``NAME = <int expression>`` (tuples too) with their values."""
    found: dict[str, int] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts, strict=False)
                     if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                     else [(target, node.value)])
            for name, expr in pairs:
                try:
                    got = eval(compile(ast.Expression(expr), "<constant>", "eval"), {})
                except Exception:  # noqa: BLE001 (anything that is no plain constant)
                    continue
                if isinstance(name, ast.Name) and isinstance(got, int):
                    found[name.id] = got
    return found


def test_the_int64_limit_is_defined_only_in_units() -> None:
    defining = sorted(
        f"{path.relative_to(SRC)}:{name}"
        for path in SRC.rglob("*.py")
        for name, got in _module_constants(ast.parse(path.read_text("utf-8"))).items()
        if got in (2**63 - 1, -(2**63)))
    assert defining == ["units.py:INT64_MAX"]
    assert values.INT64_MAX is units.INT64_MAX
    assert values.INT64_MIN == -units.INT64_MAX - 1


def test_both_users_keep_their_messages_at_the_limit() -> None:
    assert units.checked_byte_size(2**63 - 1, "memory_budget") == 2**63 - 1
    with pytest.raises(ValueError, match=r"^memory_budget must be .* at most 2\*\*63 - 1 "
                                         r"bytes, got 9223372036854775808$"):
        units.checked_byte_size(2**63, "memory_budget")
    assert values.int64(str(2**63 - 1)) == 2**63 - 1
    assert values.int64(str(-(2**63))) == -(2**63)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^expected an integer in \[-2\*\*63, "
                                                         r"2\*\*63 - 1\] \(int64\), got "
                                                         r"9223372036854775808$"):
        values.int64(str(2**63))
    with pytest.raises(argparse.ArgumentTypeError, match=r"above the largest size "
                                                         r"9223372036854775807 \(2\*\*63 - 1\)$"):
        values.byte_size()("8388608TiB")  # 2**63 bytes
