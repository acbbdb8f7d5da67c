"""Run directories: what a run writes, refusing to replace a user's files, one live run each.

A run directory (``memfine train --out DIR``) holds :data:`RUN_FILES`. A new run refuses a
directory that already holds any of them unless told to replace them (``overwrite``) or to
continue (``resume``); it never writes into a data directory it reads. While it runs it holds
``DIR/.memfine.lock`` with its process id: a second run on the same directory stops with a message
naming the live run's pid. A lock left by a process that no longer exists is taken over.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from memfine.runs.checkpoint import CHECKPOINT_NAME, SHARDED_NAME
from memfine.data import BUILTIN_CORPORA

RUN_FILES = ("config.json", "metrics.jsonl", CHECKPOINT_NAME, SHARDED_NAME, "summary.json",
             "sample.txt", "loss.png", "chunks.png", "tensorboard")
LOCK_NAME = ".memfine.lock"


def check_run_dir(out_dir: Path, *, data: str, resume: bool, overwrite: bool) -> None:
    """Refuse an output directory that would replace files or write into the training data.

    Args:
        out_dir: the run directory (may not exist yet).
        data: ``TrainConfig.data`` (a built-in corpus name or a path).
        resume: the run continues the checkpoint in ``out_dir``.
        overwrite: the user asked to replace an earlier run's files.

    Raises:
        ValueError: when ``out_dir`` is a file, equals or lies inside the data directory (when
            ``data`` is a directory), or
            holds run files and neither ``resume`` nor ``overwrite`` is set.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is a file; give a directory")
    data_dir = Path(data).expanduser().resolve() if data not in BUILTIN_CORPORA else None
    if data_dir is not None and data_dir.is_dir():
        out = out_dir.expanduser().resolve()
        if out == data_dir or data_dir in out.parents:
            raise ValueError(f"--out {str(out_dir)!r} lies in the data directory "
                             f"{str(data_dir)!r}: run files there would become training text of "
                             f"the next run; choose an --out outside it")
    if resume or overwrite:
        return
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if present:
        raise ValueError(f"--out {str(out_dir)!r} already holds {', '.join(present)}; pass "
                         f"--resume to continue that run, --overwrite to replace it, or choose "
                         f"another --out")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def run_lock(out_dir: Path) -> Iterator[Path]:
    """Hold ``out_dir/.memfine.lock`` (this process's pid) for the block; remove it after.

    Yields:
        The lock file's path.

    Raises:
        ValueError: naming the pid when another live process holds the lock.
    """
    path = out_dir / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            pid = _read_pid(path)
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                raise ValueError(f"--out {str(out_dir)!r} is in use by a running memfine train "
                                 f"(pid {pid}, lock file {str(path)!r}); wait for it to finish, "
                                 f"stop it, or choose another --out") from None
            path.unlink(missing_ok=True)  # left by a process that is gone: take it over
    else:
        raise ValueError(f"cannot take the lock {str(path)!r}; remove it if no run is using "
                         f"{str(out_dir)!r}")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    try:
        yield path
    finally:
        if _read_pid(path) == os.getpid():
            path.unlink(missing_ok=True)
