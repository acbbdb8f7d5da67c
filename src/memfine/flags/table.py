"""Flag tables shared by the subcommands: one pattern, one "not given" marker, one int-list parser.

Each subcommand lists its flags as :class:`Flag` rows and adds them with :func:`add_flags`. A flag
is named after the config field it sets (``--num-chunks`` sets ``ChunkConfig.num_chunks``), with
the same name in every subcommand; older spellings stay accepted as hidden aliases. A flag that
was not given keeps a :class:`NotGiven` default, which is how a given value is told from an
untouched one (``given``); :func:`value` unwraps either. ``--config FILE`` (TOML) fills the flags
that were not given (:func:`apply_config_file`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfine._checks import FieldError
from memfine.units import parse_bytes


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
    :func:`name_flag`.
    """
    return {path.rpartition(".")[2]: (flag.name, getattr(args, flag.dest))
            for flag in flags if given(args, flag.dest) for path in flag.paths}


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


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def int64(text: str) -> int:
    """An argparse ``type`` for an int flag: an integer within int64, what torch can hold.

    Python ints are unbounded, so ``--seed 100000000000000000000000`` would parse and then fail
    deep inside torch ("Overflow when unpacking long long"); ``1e23`` is refused as no integer.

    Raises:
        argparse.ArgumentTypeError: on a non-integer or a value outside int64 (argparse names
            the flag).
    """
    try:
        got = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not INT64_MIN <= got <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**63 - 1] (int64), "
                                         f"got {text}")
    return got


int64.__name__ = "int"  # argparse's "invalid int value" if it ever shows


def finite_float(text: str) -> float:
    """An argparse ``type`` for a float flag: a finite number (no ``inf`` or ``nan``).

    Raises:
        argparse.ArgumentTypeError: on a non-number, an infinity or a NaN (argparse names the
            flag).
    """
    try:
        got = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(got):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return got


finite_float.__name__ = "float"


def comma_ints(text: str) -> tuple[int, ...]:
    """Parse ``"1,2,4,8"`` into ``(1, 2, 4, 8)`` (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: when an item is not an int (argparse names the flag).
    """
    try:
        items = [int(item) for item in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 1,2,4,8, got "
                                         f"{text!r}") from None
    return tuple(int64(str(item)) for item in items)


def path_flag(text: str) -> Path:
    """An argparse ``type`` for a path flag (``--out``, ``--init-from``, ``--to``).

    An empty value is refused: ``Path("")`` is the current directory, so ``--out ""`` (an
    unset shell variable) would scatter a run's files there. A leading ``~`` is the home
    directory, as in the shell, which does not expand it in ``--out=~/runs/x``.

    Raises:
        argparse.ArgumentTypeError: on an empty or blank value (argparse names the flag).
    """
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (for the current "
                                         "directory give '.')")
    return Path(text).expanduser()


def text_flag(text: str) -> str:
    """An argparse ``type`` for a text flag that names something (``--data``): not blank.

    An empty value (an unset shell variable) must not fall back to a default or, read as a
    path, to the current directory.

    Raises:
        argparse.ArgumentTypeError: on an empty or blank value (argparse names the flag).
    """
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"expected a value, got {text!r}")
    return str(text)


def byte_size(keyword: str | None = None) -> Callable[[str], int | None]:
    """An argparse ``type`` for a byte size that names its unit (``512MiB``, ``80GiB``, ``80GB``).

    A bare number is refused (:func:`memfine.units.parse_bytes` with ``require_unit``): on a
    command line it is meant as MiB or GiB, and reading it as bytes would be a silent wrong
    answer.

    Args:
        keyword: a word that stands for None (``"none"``, ``"auto"``; case-insensitive), or None
            when every value must be a size.

    Returns:
        The converter: bytes (int > 0), or None for ``keyword``; it raises
        ``argparse.ArgumentTypeError`` (argparse names the flag, exit status 2).
    """
    def convert(text: str) -> int | None:
        if keyword is not None and str(text).strip().lower() == keyword:
            return None
        try:
            return parse_bytes(text, require_unit=True)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = "byte size"  # argparse's "invalid <name> value" if it ever shows
    return convert


def check_device(device: str, flag: str = "--device") -> str:
    """Refuse a torch device this machine cannot run before anything is loaded or written.

    Returns:
        ``device`` unchanged.

    Raises:
        ValueError: naming the flag when ``device`` is not a torch device string, or asks for
            CUDA where this torch has no CUDA device.
    """
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {device!r} is not a torch device; use cpu or cuda[:i]"
                         ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device} needs CUDA, and this torch has no CUDA device "
                         f"(torch {torch.__version__}); use {flag} cpu")
    return device


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
    by_key: dict[str, Flag] = {}
    for flag in flags:
        for name in (flag.name, *flag.aliases):
            by_key[flag_dest(name)] = flag
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


THREADS_FLAG = Flag("--threads", (), "CPU threads for torch; the small models here gain little "
                    "from more, and on a CPU shared with other jobs more threads can be many "
                    "times slower; more than this process's CPUs (shared by the local ranks "
                    "under torchrun) is lowered to them with a warning", default=NotGiven(1))
"""``--threads`` of ``memfine train``, ``generate`` and ``eval`` (default 1)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else ``os.cpu_count()``), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def clamp_threads(threads: int, flag: str = "--threads") -> int:
    """``threads`` at most this process's share of the CPUs, with a one-line warning if lowered.

    ``torch.set_num_threads`` takes any count and oversubscribes the CPUs, which makes every
    operator many times slower; torchrun likewise sets ``OMP_NUM_THREADS`` and warns. The share
    is :func:`usable_cpus` over torchrun's ``LOCAL_WORLD_SIZE`` (the ranks of this host).

    Raises:
        ValueError: naming ``flag`` when ``threads`` is below 1.
    """
    if threads < 1:
        raise ValueError(f"{flag} must be >= 1, got {threads}")
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    share = max(usable_cpus() // local, 1)
    if threads > share:
        ranks = f" shared by {local} local ranks" if local > 1 else ""
        print(f"warning: {flag} {threads} is more than the {share} CPU(s) this process may use"
              f"{ranks}; using {share}", file=sys.stderr)
        return share
    return threads


def checked_threads(args: argparse.Namespace) -> int:
    """The ``--threads`` value, lowered to this process's CPUs (:func:`clamp_threads`).

    Raises:
        ValueError: naming the flag when it is below 1.
    """
    return clamp_threads(int(value(args, "threads")))
