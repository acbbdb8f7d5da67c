"""Flag tables shared by the subcommands: one pattern, one "not given" marker, ``--config`` files.

Each subcommand lists its flags as :class:`Flag` rows (their value parsers:
:mod:`memfine.flags.values`) and adds them with :func:`add_flags`. A flag is named after the config
field it sets (``--num-chunks`` sets ``ChunkConfig.num_chunks``), with the same name in every
subcommand; older spellings stay accepted as hidden aliases. A flag that was not given keeps a
:class:`NotGiven` default, which is how a given value is told from an untouched one (``given``);
:func:`value` unwraps either. ``--config FILE`` (TOML) fills the flags that were not given
(:func:`apply_config_file`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfine._checks import FieldError
from memfine.flags.values import int64


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


def flag_dest(flag: str) -> str:
    """The namespace attribute argparse gives a ``--long-flag``: ``long_flag``."""
    return flag[2:].replace("-", "_")


def value(args: argparse.Namespace, dest: str) -> Any:
    """The flag's value: as given, or its :class:`NotGiven` default's ``value``."""
    got = getattr(args, dest)
    return got.value if isinstance(got, NotGiven) else got


def typed_fields(args: argparse.Namespace, flags: Iterable[Flag]
                 ) -> dict[str, tuple[str, Any]]:
    """Config field → (flag, value as parsed) of each flag in ``flags`` that was given.

    The field is the last part of each of the flag's :attr:`Flag.paths`; the input of
    :func:`name_flag`. A list that one argument's ``type`` parsed (a comma-separated flag such
    as ``--lora-targets w_up,w_up``, no ``nargs``) is given back as typed: ``"w_up,w_up"``.
    """
    return {path.rpartition(".")[2]: (flag.name, _as_typed(flag, getattr(args, flag.dest)))
            for flag in flags if given(args, flag.dest) for path in flag.paths}


def _as_typed(flag: Flag, got: Any) -> Any:
    """A comma-separated flag's parsed list as its one argument was typed (``1,2,4``)."""
    if flag.nargs is None and isinstance(got, (list, tuple)):
        return ",".join(map(str, got))
    return got


def flag_names(flags: Iterable[Flag]) -> dict[str, str]:
    """Config field → the flag that sets it, for every flag (:func:`name_flag`'s ``names``)."""
    return {path.rpartition(".")[2]: flag.name for flag in flags for path in flag.paths}


_FIELD_REF = re.compile(r"\b(?:[A-Z]\w*\.|[a-z_]+\.)*([a-z_][a-z0-9_]*)\b(?==|\s+must\b)")


def name_flag(err: ValueError, typed: Mapping[str, tuple[str, Any]],
              names: Mapping[str, str] | None = None) -> str:
    """A config error in the words of the command line that caused it.

    A :class:`memfine._checks.FieldError` on a field set by a flag the user gave names that
    flag, what it allows as typed and the value given: ``TrainConfig.lr must be in (0.0, inf),
    got -0.001`` becomes ``--lr must be > 0, got -0.001``. With ``names``, an error on a field
    the user did not set (a check across fields: ``--num-experts 1`` against the preset's
    ``top_k``) names the flags of every field it mentions and the flags given:
    ``MoEConfig.top_k must be in [1, num_experts=1], got 2`` becomes ``--top-k must be in [1,
    --num-experts=1], got 2 (given: --num-experts 1)``. Any other error keeps its message.

    Args:
        err: the error raised while building the config.
        typed: config field → (flag, value as given), e.g. from :func:`typed_fields`.
        names: config field → flag for every flag of the command (:func:`flag_names`).

    Returns:
        The one-line message.
    """
    mentioned: list[str] = []

    def flag_of(match: re.Match[str]) -> str:
        field = match.group(1)
        if not names or field not in names:
            return match.group(0)
        mentioned.append(field)
        return names[field]

    if isinstance(err, FieldError) and err.field in typed:
        flag, got = typed[err.field]
        return f"{flag} must be {_FIELD_REF.sub(flag_of, err.plain)}, got {_shown(got)}"
    text = _FIELD_REF.sub(flag_of, str(err))
    given_flags = dict.fromkeys(f"{typed[f][0]} {_shown(typed[f][1])}" for f in mentioned
                                if f in typed)
    return text + (f" (given: {', '.join(given_flags)})" if given_flags else "")


def _shown(got: Any) -> str:
    """A value as typed; an empty or space-padded string quoted, so that it shows."""
    if isinstance(got, (list, tuple)):
        return " ".join(map(str, got))
    if isinstance(got, str) and (not got.strip() or got != got.strip()):
        return repr(got)
    return str(got)


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag and the config fields it sets.

    Attributes:
        name: the flag, e.g. ``"--num-chunks"`` (the config field's name, dashed).
        paths: dotted config fields it sets (``("model.chunk.num_chunks",)``); empty for run
            options that belong to no config.
        help: help text (the default is appended by the formatter).
        type: argparse ``type`` (ignored with ``action``); :func:`int64` by default, and
            :func:`finite_float` for numbers.
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
    type: Any = int64
    choices: Any = None
    default: Any = None
    nargs: str | None = None
    action: Any = None
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """The attribute on the parsed namespace (``--num-chunks`` → ``num_chunks``)."""
        return flag_dest(self.name)


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


def apply_config_file(args: argparse.Namespace, path: str | Path, flags: Iterable[Flag]) -> None:
    """Fill flags not given on the command line from a TOML file (flags given win).

    The file is flat: one ``key = value`` per flag, the key being the flag's name without the
    dashes and with underscores (``max_steps = 400``, ``memory_budget = "16MiB"``,
    ``bins = [1, 2, 4]``, ``plot = true``). Strings go through the flag's parser, as on the
    command line.

    Raises:
        ValueError: naming the file and the key on an unreadable file, an unknown key, or a
            value the flag does not accept (also when the command line gives that flag too).
    """
    table = _read_toml(Path(path))
    by_key = {flag_dest(name): flag for flag in flags for name in (flag.name, *flag.aliases)}
    for key, raw in table.items():
        known = by_key.get(key)
        if known is None:
            raise ValueError(f"--config {str(path)!r}: unknown key {key!r}; allowed: "
                             f"{', '.join(sorted({f.dest for f in by_key.values()}))}")
        checked = _config_value(known, raw, f"--config {str(path)!r}: {key}")  # even if given
        if not given(args, known.dest):
            setattr(args, known.dest, checked)


def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        from memfine._optional import require

        tomllib = require("tomli")
    if path.exists() and not path.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"--config {str(path)!r} is not a regular file")
    try:
        with path.open("rb") as f:
            return dict(tomllib.load(f))
    except OSError as err:
        raise ValueError(f"--config {str(path)!r} cannot be read: {err.strerror or err}"
                         ) from err
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {str(path)!r} is not valid TOML: {err}") from err


def _config_value(flag: Flag, raw: Any, where: str) -> Any:
    """Convert one TOML value as the command line would; ValueError naming ``where``."""
    if flag.action is not None:
        if not isinstance(raw, bool):
            raise ValueError(f"{where} must be true or false, got {raw!r}")
        return raw
    if flag.nargs is not None:
        items = raw if isinstance(raw, list) else [raw]
        return [_convert(flag, str(item), where) for item in items]
    if isinstance(raw, (bool, dict)):
        raise ValueError(f"{where} must be a number or a string, got {raw!r}")
    text = ",".join(map(str, raw)) if isinstance(raw, list) else str(raw)
    return _convert(flag, text, where)


def _convert(flag: Flag, text: str, where: str) -> Any:
    try:
        out = flag.type(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
        raise ValueError(f"{where}: {err}") from None
    if flag.choices is not None and out not in flag.choices:
        raise ValueError(f"{where} must be one of {list(flag.choices)}, got {out!r}")
    return out
