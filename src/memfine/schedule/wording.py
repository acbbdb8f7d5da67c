"""The library's budget errors and warnings in a command's words (its flags), one line each.

The library names ``ChunkConfig`` fields (:data:`memfine.schedule.decision.CONFIG_NAMES`);
``memfine train`` and ``memfine bench`` name their flags (:data:`FLAG_NAMES` or a command's own
mapping).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import TextIO

from memfine.schedule.decision import CONFIG_NAMES, FLAG_NAMES, InfeasibleBudgetError


def flag_message(err: InfeasibleBudgetError) -> str:
    """The one-line message of ``err`` in the flags' words.

    It names ``--memory-budget``, ``--bins`` and ``--allow-over-budget`` instead of the
    ChunkConfig fields.
    """
    return err.message(FLAG_NAMES)


_ALLOW_ADVICE = f", or set {CONFIG_NAMES['allow']} to run with the largest bin"
"""The advice of :meth:`InfeasibleBudgetError.message` that names ``allow_over_budget``."""
_ADVICE = {"bins": f", add a larger bin to {CONFIG_NAMES['bins']}", "allow": _ALLOW_ADVICE}
"""Each advice of :meth:`InfeasibleBudgetError.message` that names a setting other than the
budget, by the setting's key."""
_UNNAMED = {"bins": "the bins"}
"""How a message describes a setting that the command has no flag for (``bins``)."""


def flag_words(text: str, names: Mapping[str, str | None] = FLAG_NAMES) -> str:
    """A budget message or warning of the library (ChunkConfig fields) in a command's flags.

    The library's over-budget warnings (``allow_over_budget``: the layer's largest bin, the
    step's least-memory plan) and errors carried as text name ``ChunkConfig.memory_budget_bytes``,
    ``ChunkConfig.bins`` and ``ChunkConfig.allow_over_budget``; each becomes the flag in
    ``names`` (keys ``budget``, ``bins``, ``allow``). A key whose value is None (a command
    without that flag: ``memfine bench`` has neither ``--bins`` nor ``--allow-over-budget``)
    drops the advice that names it, and the text describes the bins as "the bins".
    """
    for key, advice in _ADVICE.items():
        if names.get(key) is None:
            text = text.replace(advice, "")
    for key, field in CONFIG_NAMES.items():
        text = text.replace(field, names.get(key) or _UNNAMED.get(key, field))
    allow = names.get("allow")
    text = text.replace("budget_scope 'step'", "--budget-scope step")
    return text.replace("(allow_over_budget)", f"({allow})" if allow else "")


@contextlib.contextmanager
def budget_warnings_in_flags() -> Iterator[None]:
    """Inside the block, print the library's budget warnings in the flags' words, one line each.

    Other warnings are shown as usual.
    """
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
            text = str(message)
            if not any(field in text for field in CONFIG_NAMES.values()):
                shown(message, category, filename, lineno, file, line)
                return
            text = text.replace(_ALLOW_ADVICE, "")  # it is set: the warning says what runs
            print(f"warning: {flag_words(text)}", file=file or sys.stderr)

        warnings.showwarning = show
        yield
