"""README's Quick start: every ``memfine`` command parses, and every path it reads is in the
repository (so the block works as written on a fresh clone)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from memfine.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
READ_FLAGS = ("--data", "--config")  # paths a command reads; --out and --init-from are runs/


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README's Quick start has a bash block"
    lines = [line.split("  #", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line.startswith("memfine ")]


COMMANDS = _quick_start_commands()


def test_quick_start_covers_every_subcommand() -> None:
    used = {shlex.split(c)[1] for c in COMMANDS if not shlex.split(c)[1].startswith("-")}
    assert used == {"train", "generate", "eval", "export", "plan", "bench"}


@pytest.mark.parametrize("command", COMMANDS)
def test_quick_start_command_parses_and_reads_files_in_the_repository(command: str) -> None:
    argv = shlex.split(command)[1:]
    if {"--help", "--version", "-V"} & set(argv):
        return  # argparse exits for these; test_main.py covers --version
    _, unknown = build_parser().parse_known_args(argv)
    assert unknown == [], command
    for flag in READ_FLAGS:
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            assert value in ("pydoc", "stdlib") or (ROOT / value).exists(), (command, value)


def test_the_two_commands_are_make_targets() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    head = (ROOT / "README.md").read_text(encoding="utf-8").split("## ", 1)[0]
    for target in re.findall(r"^make (\w+)", head, re.M):
        assert re.search(rf"^{target}:", makefile, re.M), target
