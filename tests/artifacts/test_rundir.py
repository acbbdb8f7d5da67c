"""Run directories: refusing to replace files, never the data directory, the lock, clean-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfine.artifacts.checkpoint import CHECKPOINT_NAME
from memfine.artifacts.rundir import (
    LOCK_NAME,
    RUN_FILES,
    check_run_dir,
    removed_on_failure,
    run_lock,
)


@pytest.mark.parametrize("name", RUN_FILES)
def test_any_run_file_stops_a_new_run(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("the user's own file")
    if name != CHECKPOINT_NAME:
        (tmp_path / CHECKPOINT_NAME).write_text("a checkpoint to resume")
    with pytest.raises(ValueError, match=rf"already holds (.*, )?{name}(, .*)?; pass --resume "
                                         rf".* --overwrite"):
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
    with pytest.raises(ValueError, match="is not a directory; give a directory"):
        check_run_dir(tmp_path / "f", data="pydoc", resume=False, overwrite=False)


def test_out_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*f/sub/run' lies under .*f', which is not a "
                                         "directory"):
        check_run_dir(tmp_path / "f" / "sub" / "run", data="pydoc", resume=False,
                      overwrite=False)
    assert (tmp_path / "f").read_text() == "x"


def test_resume_and_overwrite_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--resume and --overwrite exclude each other"):
        check_run_dir(tmp_path, data="pydoc", resume=True, overwrite=True)


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


def test_a_failed_run_removes_what_it_created(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / "sample.txt").write_text("an earlier run's")
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError, match="step failed"), removed_on_failure(out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "metrics.jsonl").write_text("{}\n")
        (out / "tensorboard").mkdir()
        (out / "tensorboard" / "events").write_text("x")
        raise RuntimeError("step failed")
    assert not (tmp_path / "a").exists()  # both directories it created, once empty
    with pytest.raises(RuntimeError, match="step failed"), removed_on_failure(tmp_path):
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "sample.txt").write_text("this run's")
        raise RuntimeError("step failed")
    # never a file that was there before (even when the run replaced it), nor the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "sample.txt"]


@pytest.mark.parametrize("old_checkpoint", [False, True])
def test_a_run_that_saved_a_checkpoint_keeps_its_files(tmp_path: Path,
                                                       old_checkpoint: bool) -> None:
    checkpoint = tmp_path / CHECKPOINT_NAME
    if old_checkpoint:
        checkpoint.write_bytes(b"old")
    with pytest.raises(RuntimeError), removed_on_failure(tmp_path):
        (tmp_path / "config.json").write_text("{}")
        new = tmp_path / "checkpoint.pt.tmp"  # saved as the checkpoints are: write, rename
        new.write_bytes(b"new")
        os.replace(new, checkpoint)
        raise RuntimeError("diverged")
    assert (tmp_path / "config.json").exists() and checkpoint.read_bytes() == b"new"


def test_an_unchanged_old_checkpoint_does_not_keep_new_files(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"old")  # e.g. --overwrite over an earlier run
    with pytest.raises(RuntimeError), removed_on_failure(tmp_path):
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        raise RuntimeError("budget cannot be met")
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]


def test_success_keeps_everything(tmp_path: Path) -> None:
    with removed_on_failure(tmp_path / "new"):
        (tmp_path / "new").mkdir()
        (tmp_path / "new" / "config.json").write_text("{}")
    assert (tmp_path / "new" / "config.json").exists()


@pytest.mark.parametrize(("resume", "overwrite"), [(False, False), (False, True), (True, False)])
def test_a_live_run_is_named_whatever_the_flags(tmp_path: Path, resume: bool,
                                                overwrite: bool) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / CHECKPOINT_NAME).write_text("x")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(f"{sleeper.pid}\n")
        with pytest.raises(ValueError, match=rf"in use by a running memfine train "
                                             rf"\(pid {sleeper.pid}"):
            check_run_dir(tmp_path, data="pydoc", resume=resume, overwrite=overwrite)
        check_run_dir(tmp_path, data="pydoc", resume=resume, overwrite=not resume,
                      check_lock=False)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_run_killed_before_its_first_checkpoint_advises_overwrite(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / LOCK_NAME).write_text("999999999\n")  # its process is gone
    with pytest.raises(ValueError) as info:
        check_run_dir(tmp_path, data="pydoc", resume=False, overwrite=False)
    assert str(info.value) == (f"--out {str(tmp_path)!r} already holds config.json, "
                               f"metrics.jsonl but no checkpoint (a run stopped before its "
                               f"first save): pass --overwrite to replace them, or choose "
                               f"another --out")
    check_run_dir(tmp_path, data="pydoc", resume=False, overwrite=True)  # the advice works
