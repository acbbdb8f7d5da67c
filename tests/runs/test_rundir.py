"""Run directories: refusing to replace files, never the data directory, the lock (rundir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfine.runs.rundir import LOCK_NAME, RUN_FILES, check_run_dir, run_lock


@pytest.mark.parametrize("name", RUN_FILES)
def test_any_run_file_stops_a_new_run(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("the user's own file")
    with pytest.raises(ValueError, match=rf"already holds {name}; pass --resume .* --overwrite"):
        check_run_dir(tmp_path, data="pydoc", resume=False, overwrite=False)
    check_run_dir(tmp_path, data="pydoc", resume=False, overwrite=True)
    check_run_dir(tmp_path, data="pydoc", resume=True, overwrite=False)
    assert (tmp_path / name).read_text() == "the user's own file"


def test_other_files_do_not_stop_a_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    check_run_dir(tmp_path, data="pydoc", resume=False, overwrite=False)


@pytest.mark.parametrize("out", [pytest.param(".", id="the_data_directory"),
                                 pytest.param("runs/a", id="inside_it")])
def test_never_the_data_directory(tmp_path: Path, out: str) -> None:
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ValueError, match="lies in the data directory"):
        check_run_dir(tmp_path / out, data=str(tmp_path), resume=False, overwrite=True)
    check_run_dir(tmp_path.parent / "elsewhere", data=str(tmp_path), resume=False,
                  overwrite=False)


def test_out_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        check_run_dir(tmp_path / "f", data="pydoc", resume=False, overwrite=False)


def test_lock_names_the_live_pid_and_is_removed(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(f"{sleeper.pid}\n")
        with pytest.raises(ValueError, match=rf"in use by a running memfine train "
                                             rf"\(pid {sleeper.pid}"), run_lock(tmp_path):
            pass
    finally:
        sleeper.kill()
        sleeper.wait()
    # the holder is gone: its stale lock is taken over, then removed at the end
    with run_lock(tmp_path) as path:
        assert path.read_text().split() == [str(os.getpid())]
    assert not path.exists()
