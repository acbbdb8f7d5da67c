"""``memfine train``'s chunk settings on the command line: one line naming the flags, exit 2.

``--num-chunks`` given with a memory budget (which would override it) is refused; ``--resume``'s
messages show byte sizes with their unit and an unset value as ``unset``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_usage_errors import FAST, _usage_error

from memfine.cli import train as train_cli
from memfine.cli.main import build_parser, main
from memfine.config import TrainConfig

_AT = FAST.index("--preset")
RESUME = [*FAST[:_AT], *FAST[_AT + 2:], "--resume", "--max-steps", "2"]  # the saved preset
_BOTH = ("--num-chunks fixes c for every MoE layer call, --memory-budget lets MACT choose c per "
         "step and layer within the budget")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plain_run")
    assert main(["train", *FAST, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("budget_run")
    assert main(["train", *FAST, "--memory-budget", "16MiB", "--out", str(out)]) == 0
    return out


def _resolved(argv: list[str]) -> TrainConfig:
    return train_cli.resolve_config(build_parser().parse_args(["train", *argv]))[0]


# -- --num-chunks and a memory budget --------------------------------------------------------


def test_num_chunks_with_a_memory_budget_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "r")]
    line = _usage_error(["train", *FAST, "--num-chunks", "2", "--memory-budget", "16MiB", *out],
                        capsys)
    assert line == (f"memfine train: error: --num-chunks 2 and --memory-budget 16.00 MiB both "
                    f"set the chunk count c: {_BOTH}; give one of them")
    line = _usage_error(["train", *FAST, "--moe-chunks", "1", "--memory-budget", "1KiB", *out],
                        capsys)
    assert line.startswith("memfine train: error: --num-chunks 1 and --memory-budget 1024 bytes "
                           "(0.00 MiB) both set the chunk count c")
    # from a --config file, either way round, as on the command line
    toml = tmp_path / "run.toml"
    for key, flags in (("num_chunks = 4", ["--memory-budget", "16MiB"]),
                       ('memory_budget = "16MiB"', ["--num-chunks", "4"])):
        toml.write_text(key + "\n")
        line = _usage_error(["train", *FAST, "--config", str(toml), *flags, *out], capsys)
        assert line.startswith("memfine train: error: --num-chunks 4 and --memory-budget "
                               "16.00 MiB both set the chunk count c: ")
    assert not (tmp_path / "r").exists()


def test_a_default_num_chunks_or_no_budget_is_no_conflict(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "r")]
    budget = _resolved(["--memory-budget", "16MiB", *out]).model.chunk
    assert (budget.num_chunks, budget.memory_budget_bytes) == (1, 16 * 2**20)
    fixed = _resolved(["--num-chunks", "2", "--memory-budget", "none", *out]).model.chunk
    assert (fixed.num_chunks, fixed.memory_budget_bytes) == (2, None)


def test_num_chunks_against_the_budget_of_the_run_it_starts_from(
        budget_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["train", *FAST, "--init-from", str(budget_run), "--num-chunks", "2",
                         "--out", str(tmp_path / "r")], capsys)
    assert line == (f"memfine train: error: --num-chunks 2 would not be used: --init-from "
                    f"{str(budget_run)!r} sets --memory-budget 16.00 MiB ({_BOTH}); drop "
                    f"--num-chunks, or add --memory-budget none for a fixed c")
    line = _usage_error(["train", *RESUME, "--num-chunks", "1", "--out", str(budget_run)],
                        capsys)
    assert line == (f"memfine train: error: --num-chunks 1 would not be used: the checkpoint in "
                    f"--out {str(budget_run)!r} sets --memory-budget 16.00 MiB ({_BOTH}); drop "
                    f"--num-chunks")
    config = _resolved(["--init-from", str(budget_run), "--num-chunks", "2", "--memory-budget",
                        "none", "--out", str(tmp_path / "r")])
    assert (config.model.chunk.num_chunks, config.model.chunk.memory_budget_bytes) == (2, None)


# -- --resume names the changed setting with its unit ----------------------------------------


def test_resume_shows_bytes_with_their_unit_and_none_as_unset(
        budget_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resume = ["train", *RESUME, "--out", str(budget_run)]
    where = f"(the checkpoint in {str(budget_run)!r} has"
    cases = [(["--memory-budget", "none"], "--memory-budget 16.00 MiB, got unset)"),
             (["--memory-budget", "32MiB"], "--memory-budget 16.00 MiB, got 32.00 MiB)"),
             (["--backward-block-bytes", "1KiB"],
              "--backward-block-bytes unset, got 1024 bytes (0.00 MiB))"),
             (["--capacity-factor", "1.5"], "--capacity-factor unset, got 1.5)")]
    for flags, shown in cases:
        line = _usage_error([*resume, *flags], capsys)
        assert line == (f"memfine train: error: {flags[0]} cannot change on --resume {where} "
                        f"{shown}"), line


def test_resume_from_another_origin_shows_the_budget_with_its_unit(
        plain_run: Path, budget_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["train", *FAST, "--init-from", str(plain_run), "--resume",
                         "--max-steps", "2", "--out", str(budget_run)], capsys)
    assert "--init-from: --memory-budget 16.00 MiB -> unset); --resume continues" in line


def test_resume_names_every_changed_flag(plain_run: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    tiny = TrainConfig.from_dict(json.loads((plain_run / "config.json").read_text()))
    line = _usage_error(["train", *RESUME, "--lr", "0.5", "--seq-len", "16", "--out",
                         str(plain_run)], capsys)
    assert line.endswith(f"--seq-len and --lr cannot change on --resume (the checkpoint in "
                         f"{str(plain_run)!r} has --seq-len {tiny.seq_len!r}, got 16; --lr "
                         f"{tiny.lr!r}, got 0.5)")
