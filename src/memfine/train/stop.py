"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (what schedulers send).

The first signal asks the loop to stop after the current step and save a checkpoint; a second one
aborts the step. The command line then exits with 128 + the signal number (130, 143), as a shell
reports a process killed by that signal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    install handlers) the request is never set.
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
