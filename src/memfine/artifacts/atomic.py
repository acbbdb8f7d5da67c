"""Atomic ``torch.save``: a temporary file in the same directory, fsync, ``os.replace``.

A full disk is reported naming the file and the checkpoint that survived; new files get the
process's usual permissions.
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
            full (torch.save's "unexpected pos" included); other write errors as raised.
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
        Path(tmp).unlink(missing_ok=True)
        if _out_of_space(err, path.parent):
            raise OSError(errno.ENOSPC, _no_space_message(path)) from err
        raise


_WRITE_FAILURES = ("unexpected pos", "file write failed")  # torch.save's words for a short write
_LOW_SPACE_BYTES = 64 * 1024 ** 2


def _out_of_space(err: BaseException, directory: Path) -> bool:
    """Whether a failed save ran out of disk.

    ENOSPC/EDQUOT, or torch.save's short write on a file system with (almost) no space left.
    """
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(err, RuntimeError) or not any(w in str(err) for w in _WRITE_FAILURES):
        return False
    try:
        return shutil.disk_usage(directory).free < _LOW_SPACE_BYTES
    except OSError:
        return True  # the write stopped short and the disk cannot even be asked


def _no_space_message(path: Path) -> str:
    """Which file could not be written and which checkpoint is left."""
    survivor = (f"the previous checkpoint {str(path)!r} is intact" if path.is_file()
                else "no checkpoint was saved")
    return (f"no space left on the device writing {str(path)!r}; {survivor}; free space "
            f"and --resume")


def file_mode() -> int:
    """Permissions of a newly created file: ``0o666`` less the process's umask (e.g. 0o644)."""
    mask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(mask)
    return 0o666 & ~mask
