"""Atomic ``torch.save``: a temporary file in the same directory, fsync, ``os.replace``.

A full disk or the file-size limit (``ulimit -f``) is reported naming the file, the checkpoint
that survived and what to do next; new files get the process's usual permissions.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_save(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, fsync, ``os.replace``.

    Raises:
        OSError: ``ENOSPC`` naming ``path`` and the checkpoint that survived when the disk is
            full, ``EFBIG`` when the file-size limit stopped the write (torch.save's
            "unexpected pos" included); other write errors as raised.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        written = _size(tmp)
        Path(tmp).unlink(missing_ok=True)
        limit = _file_size_limit()
        if limit is not None and _short_write(err, errno.EFBIG) and written >= limit:
            raise OSError(errno.EFBIG, _too_large_message(path, limit)) from err
        if _out_of_space(err, path.parent):
            raise OSError(errno.ENOSPC, _no_space_message(path)) from err
        raise


_WRITE_FAILURES = ("unexpected pos", "file write failed")  # torch.save's words for a short write
_LOW_SPACE_BYTES = 64 * 1024 ** 2


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _short_write(err: BaseException, code: int) -> bool:
    """An OSError with ``code``, or torch.save's words for a write that stopped short."""
    if isinstance(err, OSError):
        return err.errno == code
    return isinstance(err, RuntimeError) and any(w in str(err) for w in _WRITE_FAILURES)


def _file_size_limit() -> int | None:
    """The process's file-size limit in bytes (``ulimit -f``), or None when unlimited.

    Python ignores SIGXFSZ, so a write past the limit fails with EFBIG (torch.save: "unexpected
    pos") instead of killing the process.
    """
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _too_large_message(path: Path, limit: int) -> str:
    """The file-size limit stopped the save: which file, the limit, and what is left."""
    return (f"the file-size limit (ulimit -f: {limit:,} bytes) stopped writing {str(path)!r}; "
            f"{_survivor(path)}; raise the limit (ulimit -f unlimited) and "
            f"{_next_step(path)}")


def _out_of_space(err: BaseException, directory: Path) -> bool:
    """Whether a failed save ran out of disk.

    ENOSPC/EDQUOT, or torch.save's short write on a file system with (almost) no space left.
    """
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if not _short_write(err, errno.ENOSPC):
        return False
    try:
        return shutil.disk_usage(directory).free < _LOW_SPACE_BYTES
    except OSError:
        return True  # the write stopped short and the disk cannot even be asked


def _no_space_message(path: Path) -> str:
    """Which file could not be written, which checkpoint is left and what to do."""
    return (f"no space left on the device writing {str(path)!r}; {_survivor(path)}; free space "
            f"and {_next_step(path)}")


def _survivor(path: Path) -> str:
    """What a failed save of ``path`` left: the previous checkpoint, or none."""
    if path.is_file():
        return f"the previous checkpoint {str(path)!r} is intact"
    return ("no checkpoint was saved, so a training run removes the files it created in "
            f"{str(path.parent)!r}")


def _next_step(path: Path) -> str:
    """``--resume`` when a checkpoint is there to continue, else running the command again."""
    return "--resume" if path.is_file() else "run the same command again"


def file_mode() -> int:
    """Permissions of a newly created file: ``0o666`` less the process's umask (e.g. 0o644)."""
    mask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(mask)
    return 0o666 & ~mask
