"""Self-test of tests/tolerances.py, and the rule that no other test file holds a tolerance literal.

Each bound is hit from both sides: a correct output perturbed just past the bound must fail the
comparison, and one perturbed just inside must pass (docs/style.md §6, "One tolerance table").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tolerances
from tolerances import (
    CHUNKED_ATOL,
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_PARAM_ATOL,
    FORWARD,
    GRAD,
    LOSS_ATOL,
    assert_close,
)

MARGIN = 1e-3  # relative distance from the bound; the test's own resolution, not a tolerance
TABLE = [pytest.param(grad, dtype, id=f"{'grad' if grad else 'forward'}-{str(dtype)[6:]}")
         for grad, table in ((False, FORWARD), (True, GRAD)) for dtype in table]


@pytest.mark.parametrize(("grad", "dtype"), TABLE)
@pytest.mark.parametrize("expected_value", [0.0, 3.0, -250.0], ids=["atol", "mixed", "rtol"])
def test_bound_is_sharp(grad: bool, dtype: torch.dtype, expected_value: float) -> None:
    atol, rtol = (GRAD if grad else FORWARD)[dtype]
    expected = torch.tensor([1.0, expected_value, -2.0], dtype=torch.float64)
    bound = atol + rtol * abs(expected_value)
    for sign in (1.0, -1.0):
        inside = expected.clone()
        inside[1] += sign * bound * (1 - MARGIN)
        assert_close(inside, expected, grad=grad, dtype=dtype)
        outside = expected.clone()
        outside[1] += sign * bound * (1 + MARGIN)
        with pytest.raises(AssertionError):
            assert_close(outside, expected, grad=grad, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_native_dtype_selects_its_row(dtype: torch.dtype) -> None:
    atol, _ = FORWARD[dtype]
    expected = torch.zeros(3, dtype=torch.float64)
    assert_close(torch.full((3,), atol * (1 - 10 * MARGIN), dtype=dtype), expected)
    with pytest.raises(AssertionError):
        assert_close(torch.full((3,), atol * (1 + 10 * MARGIN), dtype=dtype), expected)


def test_rows_are_ordered_and_complete() -> None:
    for table in (FORWARD, GRAD):
        assert set(table) == {torch.float64, torch.float32, torch.bfloat16}
        f64, f32, bf16 = (table[d] for d in (torch.float64, torch.float32, torch.bfloat16))
        assert f64[0] < f32[0] < bf16[0] and f64[1] < f32[1] < bf16[1]
    for dtype in FORWARD:
        assert FORWARD[dtype][0] <= GRAD[dtype][0] and FORWARD[dtype][1] <= GRAD[dtype][1]


@pytest.mark.parametrize("atol", [CHUNKED_ATOL, LOSS_ATOL, DISTRIBUTED_LOSS_ATOL,
                                  DISTRIBUTED_PARAM_ATOL],
                         ids=["chunked", "loss", "distributed_loss", "distributed_param"])
def test_absolute_bounds_are_sharp(atol: float) -> None:
    expected = torch.tensor([0.5, -1.0], dtype=torch.float64)
    torch.testing.assert_close(expected + atol * (1 - MARGIN), expected, atol=atol, rtol=0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(expected + atol * (1 + MARGIN), expected, atol=atol, rtol=0)


def test_message_prefix() -> None:
    with pytest.raises(AssertionError, match="^grad w_up: "):
        assert_close(torch.ones(2), torch.zeros(2), grad=True, msg="grad w_up")


def _tolerance_literals(path: Path) -> list[str]:
    """``atol=``/``rtol=`` keywords (and tolerance-named assignments) given a non-zero number."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        pairs: list[tuple[str, ast.expr]] = []
        if isinstance(node, ast.Call):
            pairs = [(kw.arg, kw.value) for kw in node.keywords if kw.arg]
        elif isinstance(node, ast.Assign):
            pairs = [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        for name, value in pairs:
            lowered = name.lower()
            if not (lowered in ("tol", "atol", "rtol") or lowered.endswith(("_tol", "_atol",
                                                                            "_rtol"))):
                continue
            if isinstance(value, ast.UnaryOp):
                value = value.operand
            if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)) \
                    and not isinstance(value.value, bool) and value.value != 0:
                found.append(f"{path}:{node.lineno}: {name}={value.value}")
    return found


def test_no_tolerance_literal_outside_the_table() -> None:
    tests_dir = Path(tolerances.__file__).parent
    files = [p for p in sorted(tests_dir.rglob("*.py")) if p.name != "tolerances.py"]
    offenders = [hit for path in files for hit in _tolerance_literals(path)]
    assert not offenders, "tolerances belong in tests/tolerances.py:\n" + "\n".join(offenders)


def test_literal_finder_catches_a_literal(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text("import torch\ntorch.testing.assert_close(a, b, atol=1e-5, rtol=0)\n"
                      "ATOL = 2e-3\nok = dict(atol=0)\n")
    hits = sorted(hit.split(": ")[1] for hit in _tolerance_literals(sample))
    assert hits == ["ATOL=0.002", "atol=1e-05"]
