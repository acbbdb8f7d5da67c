"""Planner: byte sizes, s′_max (MemFine Eq. 8) and the binned chunk count (Eq. 9), hand-worked."""

from __future__ import annotations

import re

import pytest

from memfine.memory.planner import (
    SEARCH_LIMIT,
    ChunkChoice,
    choose_num_chunks,
    largest_fitting,
    s_prime_max,
)
from memfine.units import parse_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 * 2**20),
    ("2GiB", 2 * 2**30),
    ("1.5GiB", 3 * 2**29),
    ("64GB", 64 * 10**9),
    ("4096", 4096),
    (" 1 KiB ", 1024),
    (123, 123),
])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1GiB", "0", 0, "1..2MiB"])
def test_parse_bytes_rejects(text: str | int) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 * 2**20), ("80GB", 80 * 10**9), ("1 KiB", 1024), ("4096B", 4096),
    (4096, 4096),  # an int is bytes: only text needs to name its unit
])
def test_parse_bytes_require_unit_accepts_sizes_with_a_unit(text: str | int,
                                                            expected: int) -> None:
    assert parse_bytes(text, require_unit=True) == expected


@pytest.mark.parametrize("text", ["80", " 16 ", "1.5"])
def test_parse_bytes_require_unit_refuses_a_bare_number(text: str) -> None:
    with pytest.raises(ValueError, match=f"byte size needs a unit, e.g. {text.strip()}MiB, "
                                         f"{text.strip()}GiB or {text.strip()}GB, got"):
        parse_bytes(text, require_unit=True)


@pytest.mark.parametrize(("budget", "fixed", "row", "expected"), [
    (10_000, 2_000, 100, 80),     # (10000 - 2000) / 100
    (10_099, 2_000, 100, 80),     # floored
    (10_100, 2_000, 100, 81),
    (2_000, 2_000, 100, 0),       # only the fixed part fits
    (1_000, 2_000, 100, -10),     # not even the fixed part
])
def test_s_prime_max_eq8(budget: int, fixed: int, row: int, expected: int) -> None:
    assert s_prime_max(budget, fixed, row) == expected


def test_s_prime_max_rejects_row_bytes() -> None:
    with pytest.raises(ValueError, match="row_bytes"):
        s_prime_max(100, 0, 0)


@pytest.mark.parametrize(("recv", "s_max", "needed", "expected"), [
    (0, 512, 1, 1),        # nothing received: the smallest bin
    (512, 512, 1, 1),
    (513, 512, 2, 2),      # ceil(513/512) = 2
    (1025, 512, 3, 4),     # ceil = 3 → bin 4
    (4096, 512, 8, 8),
    (8192, 512, 16, 16),   # needs the bin 16
])
def test_choose_num_chunks_eq9(recv: int, s_max: int, needed: int, expected: int) -> None:
    choice = choose_num_chunks(recv, s_max, (1, 2, 4, 8, 16))
    assert choice == ChunkChoice(chunks_needed=needed, num_chunks=expected) and choice.fits


def test_choose_num_chunks_over_largest_bin_reports_the_need() -> None:
    choice = choose_num_chunks(4097, 512, (1, 2, 4, 8))
    assert choice == ChunkChoice(chunks_needed=9, num_chunks=None) and not choice.fits


@pytest.mark.parametrize("s_max", [0, -10])
def test_choose_num_chunks_non_positive_s_max_needs_no_c(s_max: int) -> None:
    """s′_max ≤ 0: the fixed part alone is over budget; no chunk count helps, even at s″ = 0."""
    assert choose_num_chunks(10, s_max, (1, 2)) == ChunkChoice(chunks_needed=None,
                                                                 num_chunks=None)
    assert not choose_num_chunks(0, s_max, (1, 2)).fits


def test_choose_num_chunks_rejects_negative_rows() -> None:
    with pytest.raises(ValueError, match="recv_rows must be >= 0, got -1"):
        choose_num_chunks(-1, 10, (1, 2))


@pytest.mark.parametrize("require_unit", [False, True])
@pytest.mark.parametrize("text", ["-5MiB", "-1GiB", "-.5GiB", "+0KiB", "0MiB", "-5", "0"])
def test_parse_bytes_says_a_size_below_one_byte_must_be_positive(text: str,
                                                                 require_unit: bool) -> None:
    """A sign is read, so the error is the value's, never "must look like" or "needs a unit"."""
    with pytest.raises(ValueError, match=f"^byte size must be > 0, got '{re.escape(text)}'$"):
        parse_bytes(text, require_unit=require_unit)


def test_parse_bytes_unit_error_offers_bare_bytes_only_when_allowed() -> None:
    with pytest.raises(ValueError, match="or an integer number of bytes") as loose:
        parse_bytes("16XB")
    with pytest.raises(ValueError, match="byte size must look like") as strict:
        parse_bytes("16XB", require_unit=True)
    assert "integer number of bytes" not in str(strict.value)
    assert "MiB, GiB" in str(loose.value) and "MiB, GiB" in str(strict.value)



def test_the_memory_package_has_no_import_cycle() -> None:
    """Every import inside memfine.memory, memfine.layer_timeline and memfine.timeline (module
    level or in a function) points one way."""
    import ast
    from pathlib import Path

    import memfine.layer_timeline
    import memfine.memory
    import memfine.timeline

    graph: dict[str, set[str]] = {}
    for package in (memfine.memory, memfine.layer_timeline, memfine.timeline):
        root = Path(package.__file__).parent
        for path in root.rglob("*.py"):
            name = ".".join(("memfine", *path.relative_to(root.parent).with_suffix("").parts))
            graph.setdefault(name.removesuffix(".__init__"), set())
    for name in list(graph):
        module_path = Path(memfine.memory.__file__).parents[1].joinpath(*name.split(".")[1:])
        path = module_path.with_suffix(".py") if module_path.with_suffix(".py").exists() \
            else module_path / "__init__.py"
        deps = graph[name]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    ("memfine.memory", "memfine.layer_timeline", "memfine.timeline")):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
    seen: dict[str, int] = {}

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, " -> ".join((*stack, module))
        if seen.get(module):
            return
        for dep in graph.get(module, ()):
            if dep in graph and dep != module:
                visit(dep, (*stack, module))
        seen[module] = 1

    for module in graph:
        visit(module, ())
    assert "memfine.layer_timeline.shared" in graph


@pytest.mark.parametrize("largest", [-1, 0, 1, 2, 3, 7, 8, 9, 1000, 2**33 + 5])
def test_largest_fitting_finds_the_last_count_that_fits(largest: int) -> None:
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= largest

    assert largest_fitting(fits) == largest
    assert len(calls) <= 2 * max(1, largest).bit_length() + 3  # doubling, then bisection


def test_largest_fitting_stops_at_its_limit() -> None:
    assert largest_fitting(lambda n: True) == SEARCH_LIMIT
