"""Flag tables shared by the subcommands: one pattern, one "not given" marker, one int-list parser.

Each subcommand lists its flags as :class:`Flag` rows and adds them with :func:`add_flags`. A flag
is named after the config field it sets (``--num-chunks`` sets ``ChunkConfig.num_chunks``), with
the same name in every subcommand; older spellings stay accepted as hidden aliases. A flag that
was not given keeps a :class:`NotGiven` default, which is how a given value is told from an
untouched one (``given``); :func:`value` unwraps either.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class NotGiven:
    """Default of a flag that was not given.

    Args:
        value: what the subcommand uses when the flag is absent (None: decided later, e.g. by
            a preset).
        text: what ``--help`` prints as the default (``str(value)`` when None).
    """

    __slots__ = ("text", "value")

    def __init__(self, value: Any = None, text: str | None = None) -> None:
        """Keep ``value`` and ``text``; arguments as on the class."""
        self.value, self.text = value, text if text is not None else str(value)

    def __repr__(self) -> str:
        """The help text."""
        return self.text

    __str__ = __repr__


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the flag stored in ``dest`` was given on the command line."""
    return not isinstance(getattr(args, dest), NotGiven)


def value(args: argparse.Namespace, dest: str) -> Any:
    """The flag's value: as given, or its :class:`NotGiven` default's ``value``."""
    got = getattr(args, dest)
    return got.value if isinstance(got, NotGiven) else got


def comma_ints(text: str) -> tuple[int, ...]:
    """Parse ``"1,2,4,8"`` into ``(1, 2, 4, 8)`` (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: when an item is not an int (argparse names the flag).
    """
    try:
        return tuple(int(item) for item in str(text).split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 1,2,4,8, got "
                                         f"{text!r}") from None


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag and the config fields it sets.

    Attributes:
        name: the flag, e.g. ``"--num-chunks"`` (the config field's name, dashed).
        paths: dotted config fields it sets (``("model.chunk.num_chunks",)``); empty for run
            options that belong to no config.
        help: help text (the default is appended by the formatter).
        type: argparse ``type`` (ignored with ``action``).
        choices: allowed values, or None.
        default: the default, normally a :class:`NotGiven`; None: ask ``add_flags``'s
            ``default_for``.
        nargs: argparse ``nargs``, or None.
        action: argparse ``action`` (``"store_true"``, ``argparse.BooleanOptionalAction``), or
            None for a value flag.
        aliases: older spellings, accepted but hidden from ``--help``.
    """

    name: str
    paths: tuple[str, ...]
    help: str
    type: Any = int
    choices: Any = None
    default: Any = None
    nargs: str | None = None
    action: Any = None
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """The attribute on the parsed namespace (``--num-chunks`` → ``num_chunks``)."""
        return self.name[2:].replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag],
              default_for: Callable[[Flag], Any] | None = None) -> None:
    """Add each flag (and its hidden aliases) to ``parser``.

    Args:
        parser: the subcommand's parser.
        flags: the table.
        default_for: default of a flag whose ``default`` is None (e.g. the presets' values).

    Raises:
        ValueError: when a flag has no default and no ``default_for`` is given (a memfine bug).
    """
    for flag in flags:
        default = flag.default
        if default is None:
            if default_for is None:
                raise ValueError(f"flag {flag.name} has no default")
            default = default_for(flag)
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": default, "help": flag.help}
        if flag.action is not None:
            kwargs["action"] = flag.action
        else:
            kwargs.update(type=flag.type, choices=flag.choices, nargs=flag.nargs)
        parser.add_argument(flag.name, **kwargs)
        for alias in flag.aliases:
            parser.add_argument(alias, **{**kwargs, "help": argparse.SUPPRESS})
