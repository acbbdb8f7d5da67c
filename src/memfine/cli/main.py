"""``memfine`` command line: ``memfine train | generate | eval | export | plan | bench``.

Each subcommand lives in its own module (``memfine.cli.<name>``; ``eval`` in ``evaluate``) exposing
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported lazily so that
``memfine plan`` never imports the training stack.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import os
import re
import shlex
import sys
import typing

from memfine.runtime.stop import signals_to_caller

SUBCOMMANDS = {
    "train": "train a small MoE language model on real text",
    "generate": "continue a prompt with a trained checkpoint",
    "eval": "validation loss and bits/byte of a trained checkpoint on any text",
    "export": "write a trained checkpoint's model to safetensors with its config",
    "plan": "predict memory and the MACT chunk count for a model and cluster",
    "bench": "measure memory and speed of MoE methods side by side",
}

_MODULES = {"eval": "evaluate"}  # a module named eval would shadow the builtin in tools
_KINETO_QUIET = "6"  # above kineto's highest message level (USDT = 5)
_DASH_VALUE = re.compile(r"-\.?\d")  # "-5MiB", "-.5GiB", "-1e-3": values, not options


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``<prog>: error: <message>``.

    argparse prints the whole usage block before the message; with dozens of flags that hides
    the one line that matters. ``--help`` still prints the usage and every flag.

    A value that starts with ``-`` and a digit (``--memory-budget -5MiB``, ``--lr -1e-3``) is
    a value, not an option: argparse takes only plain negative numbers (``-5``, ``-0.5``) as
    values and reports "expected one argument" for the rest, which hides the flag's own check
    ("byte size must be > 0"). No memfine option starts with ``-`` and a digit.
    """

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        """As ``argparse.ArgumentParser``; sub-parsers are of this class too."""
        super().__init__(*args, **kwargs)
        # argparse's own test for "looks like a negative number" (an attribute of every
        # parser since Python 3.2; `_parse_optional` calls its `.match`), widened from
        # `^-\d+$|^-\d*\.\d+$` to any token starting with '-' and a digit.
        self._negative_number_matcher = _DASH_VALUE

    def error(self, message: str) -> typing.NoReturn:
        """Print ``<prog>: error: <message>`` and a --help pointer (once: :func:`_once`); exit 2."""
        self.exit(2, _once(f"{self.prog}: error: {message} (see {self.prog} --help)\n"))


def version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the package's own."""
    try:
        return importlib.metadata.version("memfine")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
        from memfine import __version__

        return __version__


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with one sub-parser per available subcommand.

    Only ``command``'s module is imported (its flags added); the others appear by name and help
    line, so ``memfine plan`` never imports the training stack. None imports every module
    (every sub-parser complete: the docs and tests that list all flags).

    Args:
        command: the subcommand about to run (``argv``'s first word), or None.
    """
    parser = _Parser(prog="memfine", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("-V", "--version", action="version", version=f"memfine {version()}")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        module = None
        if command is None or name == command:
            try:
                module = importlib.import_module(f"memfine.cli.{_MODULES.get(name, name)}")
            except ModuleNotFoundError as err:
                if err.name != f"memfine.cli.{_MODULES.get(name, name)}":
                    raise
                continue
        sub = subs.add_parser(name, help=help_text, description=help_text,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if module is not None:
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def _unknown_leading_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first option before the command that ``memfine`` itself does not take, else None.

    ``memfine`` takes ``-h``/``--help`` and ``-V``/``--version`` (or an abbreviation, as argparse
    accepts) before a command; the commands' options go after it. Without this check argparse
    reports the command as missing (``memfine --nope``) or blames the command's parser.
    """
    known = [o for action in parser._actions for o in action.option_strings]
    for token in argv:
        if not token.startswith("-") or token == "--":
            return None
        name = token.split("=", 1)[0]
        if not (name in known or (name.startswith("--") and len(name) > 2
                                  and any(o.startswith(name) for o in known))):
            return token
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _once(message: str) -> str | None:
    """``message`` on torchrun's rank 0 or a single process, None on the other ranks.

    A bad setting (a ``ValueError``, a missing package) is raised on every rank alike; its
    line is printed once.
    """
    return message if os.environ.get("RANK", "0") == "0" else None


_PATH_ERRORS = (NotADirectoryError, IsADirectoryError, FileNotFoundError, FileExistsError,
                PermissionError)
"""OS errors that mean a path given on the command line cannot be used as that flag needs."""


def _path_flag(args: argparse.Namespace, err: OSError) -> str | None:
    """The flag and value whose path ``err`` is about: the path itself or one under it.

    Returns:
        ``--flag 'value'``, or None when no path flag given on the command line leads there.
    """
    if not err.filename:
        return None
    target = os.path.abspath(os.fsdecode(err.filename))
    for dest, got in vars(args).items():
        if (dest.startswith("_") or dest == "command"
                or not isinstance(got, (str, os.PathLike)) or not str(got)):
            continue
        path = os.path.abspath(os.fspath(got))
        if target == path or target.startswith(path.rstrip(os.sep) + os.sep):
            return f"--{dest.replace('_', '-')} {os.fspath(got)!r}"
    return None


_SIGPIPE_EXIT = 141
"""128 + SIGPIPE: the exit status of a Unix program whose reader closed its standard output."""


def _stdout_closed(command: str) -> int:
    """Exit status when standard output's reader went away mid-command (``BrokenPipeError``).

    A printing command (``plan``, ``eval``, ...) has nothing left to do: 0, silently. ``train``
    stops with its run unfinished (the last checkpoint stays), so it says so on standard error
    and returns 141, as a Unix program killed by SIGPIPE would. Standard output is pointed at
    the null device first, so the interpreter's final flush cannot fail again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    if command != "train":
        return 0
    print("memfine train: stopped: its standard output was closed (e.g. by `head`); the run is "
          "not finished (--resume continues from its last checkpoint, if it wrote one)",
          file=sys.stderr)
    return _SIGPIPE_EXIT


def _signals_to_caller(command: str) -> typing.ContextManager[None]:
    """For an in-process call: a run stopped by a signal raises it again for the caller.

    ``train`` only, the one command that installs handlers; after its checkpoint.
    """
    if command != "train":
        return contextlib.nullcontext()
    return signals_to_caller()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand; returns the exit code.

    From a shell (``argv`` None) Ctrl-C ends the command with exit 130 (``train`` saves a
    checkpoint first, SIGTERM gives 143). Called in-process with ``argv`` (tests, notebooks,
    scripts), Ctrl-C belongs to the caller: ``KeyboardInterrupt`` propagates (after ``train``'s
    checkpoint, its handlers restored and the signal raised again for the caller's).
    """
    # kineto (torch.profiler's backend, used by memfine bench) prints "USDT:" trace lines at
    # every profiler start and stop unless its log level is above them; KINETO_LOG_LEVEL=0 in
    # the environment brings them back.
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)
    in_process = argv is not None  # a call inside another program: its Ctrl-C is the caller's
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)  # no top-level options
    parser = build_parser(command if command in SUBCOMMANDS else None)
    stray = _unknown_leading_option(parser, argv)
    if stray is not None:  # with a command later on the line: that line, reordered
        at = next((i for i, a in enumerate(argv) if a in SUBCOMMANDS), None)
        fix = (f"did you mean: memfine {shlex.join([argv[at], *argv[:at], *argv[at + 1:]])}"
               if at is not None else f"memfine {{{','.join(SUBCOMMANDS)}}} [options]")
        parser.error(f"unrecognized option {stray!r}: a command comes first, its options after "
                     f"it: {fix}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's parser: "memfine train: error: ..."
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with _signals_to_caller(args.command) if in_process else contextlib.nullcontext():
            return int(args._run(args))
    except ValueError as err:
        parser.exit(2, _once(f"memfine {args.command}: error: {err}\n"))
    except ImportError as err:  # an optional package missing (the message names the extra)
        if "pip install" not in str(err):
            raise
        parser.exit(2, _once(f"memfine {args.command}: error: {_first_line(err)}\n"))
    except BrokenPipeError:  # e.g. `memfine plan | head -1`: the reader left
        return _stdout_closed(args.command)
    except (OSError, RuntimeError) as err:  # files, devices, backends: one line, no traceback
        flag = _path_flag(args, err) if isinstance(err, _PATH_ERRORS) else None
        if flag is not None and isinstance(err, OSError):  # a path typed: a usage error
            parser.exit(2, f"memfine {args.command}: error: {flag}: {err.strerror or err}: "
                           f"{str(err.filename)!r}\n")
        parser.exit(1, f"memfine {args.command}: error: {type(err).__name__}: "
                       f"{_first_line(err)}\n")
    except KeyboardInterrupt:
        if in_process:
            raise
        return 130
