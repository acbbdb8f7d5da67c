"""The shared flag table (memfine.flags.table): aliases, "not given" markers, int lists."""

from __future__ import annotations

import argparse

import pytest

from memfine._checks import FieldError, check_float
from memfine.cli import bench
from memfine.cli import train as train_cli
from memfine.flags.table import Flag, NotGiven, add_flags, given, name_flag, typed_fields, value
from memfine.flags.values import comma_ints


def _parser(*flags: Flag) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, flags)
    return parser


def test_alias_sets_the_same_field_and_is_hidden_from_help() -> None:
    parser = _parser(Flag("--num-chunks", ("chunk.num_chunks",), "chunks", default=NotGiven(1),
                          aliases=("--moe-chunks",)))
    assert parser.parse_args(["--moe-chunks", "4"]).num_chunks == 4
    assert parser.parse_args(["--num-chunks", "3"]).num_chunks == 3
    assert "--moe-chunks" not in parser.format_help()
    untouched = parser.parse_args([])
    assert not given(untouched, "num_chunks") and value(untouched, "num_chunks") == 1
    assert given(parser.parse_args(["--num-chunks", "1"]), "num_chunks")


@pytest.mark.parametrize(("text", "expected"), [
    pytest.param("1,2,4,8", (1, 2, 4, 8), id="four"),
    pytest.param("3", (3,), id="one"),
    pytest.param(" 5, 6", (5, 6), id="spaces"),
])
def test_comma_ints(text: str, expected: tuple[int, ...]) -> None:
    assert comma_ints(text) == expected


def test_comma_ints_names_the_flag_on_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser(Flag("--bins", (), "bins", comma_ints, default=NotGiven((1,))))
    with pytest.raises(SystemExit):
        parser.parse_args(["--bins", "1,two"])
    assert "argument --bins: expected comma-separated ints such as 1,2,4,8, got '1,two'" in (
        capsys.readouterr().err)


def test_old_and_new_train_spellings_give_the_same_config() -> None:
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    new = parser.parse_args(["--memory-budget", "1MiB", "--bins", "1,2"])
    old = parser.parse_args(["--moe-memory-budget", "1MiB", "--chunk-bins", "1,2"])
    assert train_cli.resolve_config(new) == train_cli.resolve_config(old)
    chunk = train_cli.resolve_config(new)[0].model.chunk
    assert (chunk.memory_budget_bytes, chunk.bins) == (2**20, (1, 2))
    new, old = parser.parse_args(["--num-chunks", "2"]), parser.parse_args(["--moe-chunks", "2"])
    assert train_cli.resolve_config(new) == train_cli.resolve_config(old)
    assert train_cli.resolve_config(new)[0].model.chunk.num_chunks == 2


def test_shared_flags_have_one_name_across_subcommands() -> None:
    parsers = {}
    for name, module in (("train", train_cli), ("bench", bench)):
        parsers[name] = argparse.ArgumentParser()
        module.add_arguments(parsers[name])
    for flag in ("--memory-budget", "--hidden-size", "--intermediate-size", "--num-experts",
                 "--top-k", "--dtype", "--threads", "--device", "--seed", "--out"):
        for name, parser in parsers.items():
            assert flag in parser.format_help(), (name, flag)


class _Rate:
    """A config stand-in with one float field."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        check_float(self, "lr", 0.0, lo_open=True)


def _field_error(lr: float) -> FieldError:
    with pytest.raises(FieldError) as info:
        _Rate(lr)
    return info.value


def test_field_error_keeps_the_library_message_and_its_parts() -> None:
    err = _field_error(-0.001)
    assert isinstance(err, ValueError)
    assert str(err) == "_Rate.lr must be in (0.0, inf), got -0.001"
    assert (err.owner, err.field, err.value, err.plain) == ("_Rate", "lr", -0.001, "> 0")
    assert _field_error(float("inf")).plain == "a finite number"


def test_name_flag_words_a_field_error_as_the_flag_typed() -> None:
    flags = (Flag("--lr", ("train.lr",), "rate", float, default=NotGiven(1e-3)),
             Flag("--bins", ("model.chunk.bins",), "bins", int, default=NotGiven(), nargs="+"))
    parser = argparse.ArgumentParser()
    add_flags(parser, flags)
    args = parser.parse_args(["--lr=-1e-3", "--bins", "1", "3"])
    typed = typed_fields(args, flags)
    assert typed == {"lr": ("--lr", -0.001), "bins": ("--bins", [1, 3])}
    assert name_flag(_field_error(-0.001), typed) == "--lr must be > 0, got -0.001"
    bins = FieldError("ChunkConfig", "bins", "a tuple", (1, 3), "ints")
    assert name_flag(bins, typed) == "--bins must be ints, got 1 3"
    untyped = typed_fields(parser.parse_args([]), flags)  # nothing given: the library's words
    assert untyped == {} and name_flag(_field_error(0.0), untyped) == str(_field_error(0.0))
    assert name_flag(ValueError("lr and min_lr disagree"), typed) == "lr and min_lr disagree"
