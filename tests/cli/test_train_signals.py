"""``memfine train`` stopped by Ctrl-C or SIGTERM: from a shell, and called in-process.

From a shell the run saves a checkpoint and exits 128 + the signal number. Called in-process
(``main([...])``, as a test suite does), it saves the same checkpoint, restores the caller's
handlers and raises the signal again for them: Ctrl-C reaches the caller as
``KeyboardInterrupt``, so a test session stops with its summary. The tests wait on what the run
writes (``metrics.jsonl``), never on time; the limits of ``timeouts`` only stop a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import timeouts
from memfine.cli import evaluate as evaluate_cli
from memfine.cli.main import main
from memfine.reports.metrics import read_metrics
from memfine.train import load_checkpoint

ASSETS = Path(__file__).parents[1] / "assets"
FAST = ["--preset", "tiny", "--data", str(ASSETS / "pydoc_topics_sample.txt"), "--no-progress",
        "--threads", "1"]
ENDLESS = ["--max-steps", "100000", "--eval-every", "100000"]
RUN_BASE_S = 120  # a tiny run's start and one step on an idle machine, with a wide margin


def _steps_written(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(read_metrics(metrics)) if metrics.exists() else 0


def _wait_for_steps(out: Path, steps: int, alive: Callable[[], bool]) -> None:
    """Return once ``out/metrics.jsonl`` holds ``steps`` records, or when ``alive()`` is False."""
    base = RUN_BASE_S * steps
    limit = time.monotonic() + timeouts.scaled(base)
    while alive() and _steps_written(out) < steps:
        if time.monotonic() > limit:
            pytest.fail(timeouts.expired_message(f"waiting for {steps} steps in {out}", base))
        time.sleep(0.05)


@pytest.mark.parametrize(("signum", "code"), [
    pytest.param(signal.SIGINT, 130, id="ctrl_c"),
    # slow-only: the handler, the save and the exit code 128 + signal are ctrl_c's path, and
    # SIGTERM's own handling is test_in_process_sigterm_reaches_the_callers_handler's
    pytest.param(signal.SIGTERM, 143, id="sigterm", marks=pytest.mark.slow),
])
def test_stop_signal_saves_checkpoint_and_exits_128_plus_signal(
        tmp_path: Path, signum: int, code: int) -> None:
    """Ctrl-C or SIGTERM on `python -m memfine train`: checkpoint of the finished step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfine", "train", *FAST, *ENDLESS, "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_steps(tmp_path, 2, lambda: proc.poll() is None)
        assert proc.poll() is None, proc.communicate()
        # while it runs, the lock names its pid and a second run on the directory is refused
        assert (tmp_path / ".memfine.lock").read_text().split() == [str(proc.pid)]
        second = timeouts.run([sys.executable, "-m", "memfine", "train", *FAST, "--max-steps",
                               "1", "--out", str(tmp_path), "--overwrite"],
                              RUN_BASE_S, capture_output=True, env=env)
        assert second.returncode == 2
        assert f"in use by a running memfine train (pid {proc.pid}" in second.stderr
        proc.send_signal(signum)
        out, err = timeouts.communicate(proc, RUN_BASE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    name = signal.Signals(signum).name
    assert f"interrupted by {name}: checkpoint of step" in out and "Traceback" not in err
    step = load_checkpoint(tmp_path / "checkpoint.pt")["step"]
    assert step >= 2 and step == read_metrics(tmp_path / "metrics.jsonl")[-1]["step"]
    assert not (tmp_path / ".memfine.lock").exists()
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["checkpoint.pt"] == modes["config.json"] == modes["metrics.jsonl"], modes


@contextmanager
def _signal_after_first_step(out: Path, signum: int) -> Iterator[None]:
    """Send ``signum`` to this process once ``out`` holds a step (from a helper thread)."""
    done = threading.Event()

    def send() -> None:
        _wait_for_steps(out, 1, lambda: not done.is_set())
        if not done.is_set():
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_in_process_ctrl_c_saves_then_reaches_the_caller(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """``main(["train", ...])`` under Ctrl-C: checkpoint, handlers restored, KeyboardInterrupt.

    The caller has Python's own SIGINT handler (a process started in the background by a
    non-interactive shell inherits SIGINT ignored: it would ignore Ctrl-C, and so does the run).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with _signal_after_first_step(tmp_path, signal.SIGINT), pytest.raises(KeyboardInterrupt):
        main(["train", *FAST, *ENDLESS, "--out", str(tmp_path)])
    assert {s: signal.getsignal(s) for s in before} == before
    assert "interrupted by SIGINT: checkpoint of step" in capsys.readouterr().out
    step = load_checkpoint(tmp_path / "checkpoint.pt")["step"]
    assert step >= 1 and step == read_metrics(tmp_path / "metrics.jsonl")[-1]["step"]
    assert not (tmp_path / ".memfine.lock").exists()


def test_in_process_sigterm_reaches_the_callers_handler(tmp_path: Path) -> None:
    """The caller's own SIGTERM handler is called once, after the checkpoint, and restored."""
    calls: list[int] = []

    def caller_handler(signum: int, frame: object) -> None:
        calls.append(len(list(tmp_path.glob("checkpoint.pt"))))

    previous = signal.signal(signal.SIGTERM, caller_handler)
    try:
        with _signal_after_first_step(tmp_path, signal.SIGTERM):
            code = main(["train", *FAST, *ENDLESS, "--out", str(tmp_path)])
        assert signal.getsignal(signal.SIGTERM) is caller_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and calls == [1]  # once, with the checkpoint already written


def test_in_process_keyboard_interrupt_of_other_commands_propagates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, Ctrl-C in any command is the caller's; from a shell it is exit 130."""
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_cli, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["eval", "--out", "x"])
    monkeypatch.setattr(sys, "argv", ["memfine", "eval", "--out", "x"])
    assert main() == 130
