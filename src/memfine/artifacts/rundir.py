"""Run directories: what a run writes, refusing to replace a user's files, one live run each.

A run directory (``memfine train --out DIR``) holds :data:`RUN_FILES`. A new run refuses a
directory that already holds any of them unless told to replace them (``overwrite``) or to
continue (``resume``); it never writes into a data directory it reads. While it runs it holds
``DIR/.memfine.lock`` with its process id: a second run on the same directory stops with a message
naming the live run's pid. A lock left by a process that no longer exists is taken over. A run
that fails before it saves a checkpoint removes what it created (:func:`removed_on_failure`),
so the same command can run again into the same directory. A benchmark's ``--out`` is refused
the same way when it holds ``bench_*`` results (:func:`check_bench_out`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memfine.artifacts.checkpoint import BASE_COPY_NAME, CHECKPOINT_NAME, SHARDED_NAME
from memfine.data import BUILTIN_CORPORA

RUN_FILES = ("config.json", "metrics.jsonl", CHECKPOINT_NAME, SHARDED_NAME, "summary.json",
             "sample.txt", "loss.png", "chunks.png", "tensorboard", "wandb", BASE_COPY_NAME)
LOCK_NAME = ".memfine.lock"


def file_on_path(path: Path) -> Path | None:
    """The first of ``path`` and its parents that exists and is no directory.

    A file, device (``/dev/null``), FIFO or socket there means no directory can be made at
    ``path`` (the OS would answer ``NotADirectoryError``).

    Returns:
        That path, or None when every existing component is a directory.
    """
    path = path.expanduser().absolute()
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def check_bench_out(out: Path, overwrite: bool) -> None:
    """Refuse a bench ``--out`` that is no folder or holds ``bench_*`` files, unless ``overwrite``.

    Raises:
        ValueError: naming ``--out``, the file in the way or the earlier results' files.
    """
    blocked = file_on_path(out)
    if blocked is not None:
        raise ValueError(f"--out {str(out)!r}: {str(blocked)!r} is not a directory; give a "
                         f"directory")
    earlier = sorted(p.name for p in out.glob("bench_*"))
    if earlier and not overwrite:
        raise ValueError(f"--out {str(out)!r} already holds results ({', '.join(earlier[:4])}"
                         f"{', ...' if len(earlier) > 4 else ''}); pass --overwrite to replace "
                         f"them or choose another --out")


def check_run_dir(out_dir: Path, *, data: str, resume: bool, overwrite: bool,
                  check_lock: bool = True) -> None:
    """Refuse an output directory that would replace files or write into the training data.

    Args:
        out_dir: the run directory (may not exist yet).
        data: ``TrainConfig.data`` (a built-in corpus name or a path).
        resume: the run continues the checkpoint in ``out_dir``.
        overwrite: the user asked to replace an earlier run's files.
        check_lock: refuse a directory whose lock a live process holds (False on the ranks of
            a torchrun job other than the main one: the main rank's lock is no other run).

    Raises:
        ValueError: when ``resume`` and ``overwrite`` are both set, when nothing can be written
            in ``out_dir`` (a read-only or full file system, no permission), when a live run
            holds its lock (naming the pid, whatever ``resume``/``overwrite`` say), when
            ``out_dir`` is a file or
            lies under a file, equals or lies inside the data directory (when
            ``data`` is a directory), or
            holds run files and neither ``resume`` nor ``overwrite`` is set.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: --resume continues the "
                         "run in --out, --overwrite replaces it")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is not a directory; give a directory")
    blocked = file_on_path(out_dir.parent)
    if blocked is not None:
        raise ValueError(f"--out {str(out_dir)!r} lies under {str(blocked)!r}, which is not a "
                         f"directory; give a directory")
    data_dir = Path(data).expanduser().resolve() if data not in BUILTIN_CORPORA else None
    if data_dir is not None and data_dir.is_dir():
        out = out_dir.expanduser().resolve()
        if out == data_dir or data_dir in out.parents:
            raise ValueError(f"--out {str(out_dir)!r} lies in the data directory "
                             f"{str(data_dir)!r}: run files there would become training text of "
                             f"the next run; choose an --out outside it")
    _check_writable(out_dir)
    holder = _live_holder(out_dir / LOCK_NAME) if check_lock else None
    if holder is not None:  # named first, with or without --resume/--overwrite
        raise ValueError(_in_use(out_dir, holder))
    if resume or overwrite:
        return
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if present and not {CHECKPOINT_NAME, SHARDED_NAME} & set(present):
        raise ValueError(f"--out {str(out_dir)!r} already holds {', '.join(present)} but no "
                         f"checkpoint (a run stopped before its first save): pass --overwrite "
                         f"to replace them, or choose another --out")
    if present:
        raise ValueError(f"--out {str(out_dir)!r} already holds {', '.join(present)}; pass "
                         f"--resume to continue that run, --overwrite to replace it, or choose "
                         f"another --out")


def _live_holder(lock: Path) -> int | None:
    """The pid in the lock file ``lock`` when it is another process that is alive, else None."""
    pid = _read_pid(lock) if lock.exists() else None
    return pid if pid is not None and pid != os.getpid() and _pid_alive(pid) else None


def _in_use(out_dir: Path, pid: int) -> str:
    return (f"--out {str(out_dir)!r} is in use by a running memfine train (pid {pid}, lock file "
            f"{str(out_dir / LOCK_NAME)!r}); wait for it to finish, stop it, or choose another "
            f"--out")


def _check_writable(out_dir: Path) -> None:
    """Create and delete a file in ``out_dir`` (or its nearest existing parent).

    ``os.access`` is no test: it says yes to root on a directory without write permission,
    and says nothing about a read-only mount.

    Raises:
        ValueError: naming ``--out`` when nothing can be written there.
    """
    target = out_dir.expanduser().absolute()
    existing = next((p for p in (target, *target.parents) if p.is_dir()), None)
    if existing is None:
        return
    err = write_error(existing)
    if err is not None:
        where = "" if existing == target else f" (its parent {str(existing)!r} exists)"
        raise ValueError(f"--out {str(out_dir)!r} is not writable{where}: "
                         f"{err.strerror or err}; choose a directory you can write") from err


def write_error(directory: Path) -> OSError | None:
    """Why no file can be created in ``directory`` (an existing folder), or None when one can.

    Creates and deletes a temporary file there: ``os.access`` says yes to root on a folder
    without write permission and says nothing about a read-only mount.
    """
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".memfine-write-test."):
            pass
    except OSError as err:
        return err
    return None


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
            pid = _live_holder(path)
            if pid is not None:
                raise ValueError(_in_use(out_dir, pid)) from None
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


def _signature(path: Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of ``path``, or None when it does not exist."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


@contextlib.contextmanager
def removed_on_failure(out_dir: Path) -> Iterator[None]:
    """On an exception in the block, remove the run files and directories the block created.

    Nothing is removed when the block saved a checkpoint (``checkpoint.pt`` or
    ``checkpoint.dcp/`` is new or replaced: the directory then holds a run to ``--resume``), and
    never a file that was there before the block (an ``--overwrite`` or ``--resume`` run's
    earlier files stay). Directories created for ``out_dir`` are removed when left empty.

    Args:
        out_dir: the run directory (it may not exist yet).

    Raises:
        Whatever the block raised, after the clean-up.
    """
    before = {name: _signature(out_dir / name) for name in RUN_FILES}
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    try:
        yield
    except BaseException:
        now = {name: _signature(out_dir / name) for name in (CHECKPOINT_NAME, SHARDED_NAME)}
        if not any(sig is not None and sig != before[name] for name, sig in now.items()):
            _remove_new(out_dir, [name for name in RUN_FILES if before[name] is None], created)
        raise


def _remove_new(out_dir: Path, names: list[str], created: list[Path]) -> None:
    """Remove ``out_dir/<name>`` for ``names``, then the empty ``created`` directories."""
    for name in names:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for directory in created:
        try:
            directory.rmdir()
        except OSError:  # not empty (or gone): leave it and everything above it
            break
