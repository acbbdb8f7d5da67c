"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (what schedulers send).

The first signal asks the loop to stop after the current step and save a checkpoint; a second one
aborts the step. The command line then exits with 128 + the signal number (130, 143), as a shell
reports a process killed by that signal. Where the run is one call inside a longer-lived process
(``memfine.cli.main.main([...])`` from a test suite, a notebook or a script:
:func:`signals_to_caller`), the signal belongs to that process: after the checkpoint, the
handlers the run replaced are restored and the signal is raised again for them (Ctrl-C then
reaches the caller as ``KeyboardInterrupt``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_TO_CALLER = [False]  # inside signals_to_caller (signals reach the main thread only)


@dataclass(slots=True)
class StopRequest:
    """Set by the signal handler.

    Attributes:
        signum: the first stop signal received (``signal.SIGINT`` or ``signal.SIGTERM``), or None.
    """

    signum: int | None = None

    def is_set(self) -> bool:
        """True once a stop signal arrived."""
        return self.signum is not None


@contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """Install SIGINT and SIGTERM handlers for the block (main thread only; restored after).

    The first signal sets the yielded request's ``signum``; a second one raises
    ``KeyboardInterrupt`` inside the step in progress. Off the main thread (where Python cannot
    install handlers) the request is never set. Inside :func:`signals_to_caller`, a signal
    received is raised again after the previous handlers are restored, when the block ends
    without an exception (for SIGINT with Python's default handler: ``KeyboardInterrupt``).
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.signum = signum

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
    if stop.signum is not None and _TO_CALLER[0]:
        signal.raise_signal(stop.signum)


@contextmanager
def signals_to_caller() -> Iterator[None]:
    """Within the block, a run stopped by SIGINT or SIGTERM passes the signal on afterwards.

    For runs that are one call inside a longer-lived process (``main([...])`` in-process): the
    run still saves its checkpoint, then :func:`graceful_stop` restores the caller's handlers and
    raises the signal again for them, so Ctrl-C stops the caller too (a test session ends with
    its summary) instead of only the run.
    """
    before, _TO_CALLER[0] = _TO_CALLER[0], True
    try:
        yield
    finally:
        _TO_CALLER[0] = before
