"""The experts suite's one method table: a half-added method is refused with its name.

A method is one entry of ``LAYER_METHODS``; ``METHODS`` and ``COMPILABLE`` are read from it, and
an entry that cannot build what the harness needs fails with a ValueError naming the method and
the field to fix, never with a KeyError or a silently wrong row.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

import timeouts
from memfine.baselines.layers import CheckpointedLayer, sharing
from memfine.bench.options import BenchOptions
from memfine.suites import ALL_METHODS, experts, select_methods

CPU = torch.device("cpu")


def _build(names: tuple[str, ...]) -> list[str]:
    methods, _ = experts.build_methods(experts.QUICK, BenchOptions(), CPU, names)
    return [m.name for m in methods]


def _with_entry(monkeypatch: pytest.MonkeyPatch, name: str, entry: object) -> None:
    monkeypatch.setitem(experts.LAYER_METHODS, name, entry)


def test_methods_and_compilable_are_read_from_the_table() -> None:
    assert tuple(experts.LAYER_METHODS) == experts.METHODS
    assert experts.COMPILABLE == ("fused", "fused_mact")
    assert set(experts.METHODS) <= set(ALL_METHODS)
    assert select_methods("experts", ()) == experts.METHODS


def test_every_entry_builds_a_method_of_its_name() -> None:
    runnable = tuple(n for n in experts.METHODS if n not in experts.skipped_methods((n,)))
    assert _build(runnable) == list(runnable)


def test_a_new_entry_is_a_new_method(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_entry(monkeypatch, "argsort_example", experts.LayerMethod(
        lambda s: sharing(s.base, dataclasses.replace(s.moe, index_builder="argsort"))))
    assert _build(("fused", "argsort_example")) == ["fused", "argsort_example"]


def test_an_unknown_name_lists_the_table() -> None:
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['no_method'\].*LAYER_METHODS"):
        _build(("fused", "no_method"))


def test_an_entry_that_is_no_layer_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_entry(monkeypatch, "bare_lambda", lambda s: sharing(s.base, s.moe))
    with pytest.raises(ValueError, match=r"method 'bare_lambda'.*must be a LayerMethod"):
        _build(("bare_lambda",))


def test_a_layer_that_is_no_moe_layer_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_entry(monkeypatch, "bad", experts.LayerMethod(lambda s: torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"method 'bad'.*MoEConfig `config`.*Linear"):
        _build(("bad",))


def test_a_modelled_layer_without_a_policy_says_set_modelled_false(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _with_entry(monkeypatch, "ckpt", experts.LayerMethod(
        lambda s: CheckpointedLayer(sharing(s.base, s.moe))))
    with pytest.raises(ValueError, match=r"method 'ckpt'.*set modelled=False"):
        _build(("ckpt",))


def test_a_compilable_wrapper_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_entry(monkeypatch, "ckpt", experts.LayerMethod(
        lambda s: CheckpointedLayer(sharing(s.base, s.moe)), modelled=False, compilable=True))
    with pytest.raises(ValueError, match=r"method 'ckpt'.*compilable=True needs an MoELayer"):
        _build(("ckpt",))


def test_a_method_that_cannot_run_is_skipped_with_a_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _with_entry(monkeypatch, "needs_pkg", experts.LayerMethod(
        lambda s: sharing(s.base, s.moe), missing=lambda: "pkg is not installed"))
    opts = BenchOptions(quick=True, repeats=1, warmup=0)
    points = list(experts.run(opts, CPU, ("fused", "needs_pkg")))
    assert "experts: needs_pkg skipped: pkg is not installed" in capsys.readouterr().out
    assert [r.name for r in points[0].results] == ["fused"]


# The import-time check, run by one child process for every entry below (one start of Python,
# torch and memfine for them all): each entry is added to a fresh copy of the module's source,
# and the child prints, per entry, the last line of the error its import raised (None if none).
_CHILD = """
import importlib.util, json, sys, traceback
spec = importlib.util.find_spec("memfine.suites.experts")
source = open(spec.origin).read()
anchor = '    "fused": LayerMethod('
assert anchor in source, "the table's fused entry moved"
results = {}
for entry in json.loads(sys.argv[1]):
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        exec(compile(source.replace(anchor, entry + "\\n" + anchor, 1), spec.origin, "exec"),
             module.__dict__)
        results[entry] = None
    except Exception as error:
        results[entry] = traceback.format_exception_only(error)[-1].strip().splitlines()[-1]
print(json.dumps(results))
"""
BAD_ENTRIES = [
    ('    "x": (lambda s: sharing(s.base, s.moe)),',
     "method 'x' (LAYER_METHODS in memfine.suites.experts): the entry must be a LayerMethod"),
    ('    "y": LayerMethod(lambda s: sharing(s.base, s.moe), modelled="yes"),',
     "method 'y' (LAYER_METHODS in memfine.suites.experts): field 'modelled' must be a bool"),
    ('    "z": LayerMethod(None),',
     "method 'z' (LAYER_METHODS in memfine.suites.experts): field 'layer' must be a callable"),
]


@pytest.fixture(scope="module")
def import_errors() -> dict[str, str | None]:
    """The last error line of importing the suite module with each entry added ("": none)."""
    entries = ["", *(entry for entry, _ in BAD_ENTRIES)]
    done = timeouts.run([sys.executable, "-c", _CHILD, json.dumps(entries)], 300,
                        capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    errors: dict[str, str | None] = json.loads(done.stdout.strip().splitlines()[-1])
    return errors


@pytest.mark.parametrize(("entry", "message"), BAD_ENTRIES)
def test_a_bad_entry_fails_at_import_naming_method_and_field(
        import_errors: dict[str, str | None], entry: str, message: str) -> None:
    last = import_errors[entry]
    assert last is not None and last.startswith("ValueError: bench suite 'experts', ")
    assert message in last, last


def test_the_import_check_passes_the_committed_table(
        import_errors: dict[str, str | None]) -> None:
    assert import_errors[""] is None
