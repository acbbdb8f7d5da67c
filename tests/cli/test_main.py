"""The command line as a whole: --version, one-line usage errors, byte sizes with a unit in every
subcommand, checkpoint commands on a path that is not a run directory, no profiler noise."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import timeouts
from memfine.cli.bench import add_arguments, options_from_args
from memfine.cli.main import main


def _usage_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``memfine ARGS``; assert exit status 2 and one stderr line; return that line."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err and "usage:" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version(flag: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"memfine {importlib.metadata.version('memfine')}\n"


@pytest.mark.parametrize(("args", "line"), [
    (["train", "--bogus"], "memfine train: error: unrecognized arguments: --bogus "
                           "(see memfine train --help)"),
    (["plan", "--top", "x"], "memfine plan: error: argument --top: expected an integer, got "
                             "'x' (see memfine plan --help)"),
    ([], "memfine: error: the following arguments are required: COMMAND (see memfine --help)"),
    (["--nope"], "memfine: error: unrecognized option '--nope': a command comes first, its "
                 "options after it: memfine {train,generate,eval,export,plan,bench} [options] "
                 "(see memfine --help)"),
    (["--seed", "1", "bench"], "memfine: error: unrecognized option '--seed': a command comes "
                               "first, its options after it: did you mean: memfine bench "
                               "--seed 1 (see memfine --help)"),
    (["--out", "my runs", "bench", "--quick"], "memfine: error: unrecognized option '--out': a "
     "command comes first, its options after it: did you mean: memfine bench --out 'my runs' "
     "--quick (see memfine --help)"),
])
def test_usage_errors_are_one_line(args: list[str], line: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert _usage_error(args, capsys) == line


# Every byte-size flag (aliases too): the arguments before it, and the flag.
BYTE_SIZE_FLAGS = [
    pytest.param(["train"], "--memory-budget", id="train_memory_budget"),
    pytest.param(["train"], "--moe-memory-budget", id="train_memory_budget_alias"),
    pytest.param(["train"], "--backward-block-bytes", id="train_backward_block_bytes"),
    pytest.param(["bench"], "--memory-budget", id="bench_memory_budget"),
    pytest.param(["bench"], "--budget", id="bench_budget_alias"),
    pytest.param(["plan", "--preset", "olmoe-1b-7b"], "--device-memory",
                 id="plan_device_memory"),
    pytest.param(["plan", "--preset", "olmoe-1b-7b"], "--static-memory",
                 id="plan_static_memory"),
]


@pytest.mark.parametrize(("before", "flag"), BYTE_SIZE_FLAGS)
def test_a_bare_number_needs_a_unit_in_every_subcommand(
        before: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error([*before, flag, "16"], capsys)
    assert f"argument {flag}: byte size needs a unit, e.g. 16MiB, 16GiB or 16GB, got '16'" in line


@pytest.mark.parametrize("text", ["-5MiB", "-.5GiB", "-5", "0GiB"])
@pytest.mark.parametrize("joined", [False, True], ids=["flag_space_value", "flag_equals_value"])
@pytest.mark.parametrize(("before", "flag"), BYTE_SIZE_FLAGS)
def test_a_size_below_one_byte_gets_the_flags_own_error_in_every_subcommand(
        before: list[str], flag: str, joined: bool, text: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory-budget -5MiB`` is a value (argparse alone says "expected one argument")."""
    args = [*before, f"{flag}={text}"] if joined else [*before, flag, text]
    line = _usage_error(args, capsys)
    assert line == (f"memfine {before[0]}: error: argument {flag}: byte size must be > 0, got "
                    f"{text!r} (see memfine {before[0]} --help)")


def test_values_starting_with_a_minus_and_a_digit_are_values(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Any flag: ``--lr -1e-3`` reaches the config check; an option after a flag stays an
    option (``--memory-budget --seed`` lacks its value)."""
    assert _usage_error(["train", "--lr", "-1e-3"], capsys) == (
        "memfine train: error: --lr must be > 0, got -0.001")
    assert _usage_error(["train", "--memory-budget", "--seed", "1"], capsys) == (
        "memfine train: error: argument --memory-budget: expected one argument "
        "(see memfine train --help)")


def test_bench_memory_budget_takes_a_unit_and_auto() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cpu = torch.device("cpu")
    given = options_from_args(parser.parse_args(["--memory-budget", "1.5MiB"]), cpu)
    auto = options_from_args(parser.parse_args(["--memory-budget", "AUTO"]), cpu)
    default = options_from_args(parser.parse_args([]), cpu)
    assert given.budget_bytes == 3 * 2**19
    assert auto.budget_bytes is None and default.budget_bytes is None


@pytest.mark.parametrize("command", [["eval"], ["generate", "--prompt", "x"], ["export"]])
def test_checkpoint_commands_on_a_file_say_out_takes_a_run_directory(
        tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "checkpoint.pt"  # the file itself, where its directory was meant
    path.write_bytes(b"x")
    line = _usage_error([command[0], "--out", str(path), *command[1:]], capsys)
    assert line == (f"memfine {command[0]}: error: --out '{path}' is not a directory; --out takes "
                    f"the run directory of memfine train (the directory holding checkpoint.pt)")
    missing = tmp_path / "nope"
    line = _usage_error([command[0], "--out", str(missing), *command[1:]], capsys)
    assert f"--out '{missing}' does not exist; --out takes the run directory" in line
    assert _usage_error([command[0], *command[1:]], capsys).endswith(
        "--out is required: the run directory of memfine train")


def test_train_resume_and_init_from_on_a_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    line = _usage_error(["train", "--resume", "--out", str(path)], capsys)
    assert line == (f"memfine train: error: --out: '{path}' is a file, not a run directory (give "
                    f"the directory memfine train wrote, the one holding checkpoint.pt)")
    line = _usage_error(["train", "--init-from", str(path), "--out", str(tmp_path / "r")],
                        capsys)
    assert line == (f"memfine train: error: --init-from '{path}' is not a directory; "
                    f"--init-from takes the run directory of memfine train (the directory "
                    f"holding checkpoint.pt)")
    assert not (tmp_path / "r").exists()


def test_bench_prints_no_profiler_trace_lines(tmp_path: Path) -> None:
    # kineto prints "USDT:" lines at each torch.profiler start and stop unless told not to;
    # a fresh process, since kineto reads its log level once.
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = timeouts.run(
        [sys.executable, "-m", "memfine", "bench", "--quick", "--suites", "experts",
         "--methods", "fused", "--out", str(tmp_path)],
        600, capture_output=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "experts" in done.stdout and (tmp_path / "bench_experts.csv").exists()
    assert "USDT" not in done.stdout + done.stderr


@pytest.mark.parametrize("command", [["eval"], ["generate", "--prompt", "x"]])
@pytest.mark.parametrize(("device", "message"), [
    ("bogus", "--device 'bogus' is not a torch device; use cpu or cuda[:i]"),
    ("cuda", "--device cuda needs CUDA, and this torch has no CUDA device"),
])
def test_checkpoint_commands_refuse_a_device_before_loading(
        tmp_path: Path, command: list[str], device: str, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    line = _usage_error([command[0], "--out", str(tmp_path), "--device", device, *command[1:]],
                        capsys)
    assert line.startswith(f"memfine {command[0]}: error: {message}")


def test_export_to_a_missing_folder_names_it(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing" / "m.safetensors"
    line = _usage_error(["export", "--out", str(tmp_path), "--to", str(target)], capsys)
    assert line == (f"memfine export: error: --to '{target}': the folder '{target.parent}' does "
                    f"not exist; create it or choose another --to")


def test_train_checks_its_flags_before_the_run_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")  # an earlier run's file
    line = _usage_error(["train", "--threads", "0", "--out", str(tmp_path)], capsys)
    assert line == "memfine train: error: --threads must be >= 1, got 0"


def test_train_whose_reader_leaves_stops_with_sigpipe_status_and_says_so(tmp_path: Path) -> None:
    # `memfine train ... | head -2`: the run cannot finish, so exit 141 (128 + SIGPIPE), not 0
    corpus = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfine", "train", "--preset", "tiny", "--data", corpus,
         "--no-progress", "--threads", "1", "--max-steps", "200", "--log-every", "1",
         "--eval-batches", "1", "--sample-tokens", "0", "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line
    err = proc.stderr.read()
    assert proc.wait(timeout=timeouts.scaled(300)) == 141, err
    assert first.startswith("data:")
    assert err.strip().splitlines()[-1] == (
        "memfine train: stopped: its standard output was closed (e.g. by `head`); the run is "
        "not finished (--resume continues from its last checkpoint, if it wrote one)")


def test_plan_imports_neither_the_training_stack_nor_other_subcommands() -> None:
    script = ("import sys\nfrom memfine.cli.main import main\n"
              "assert main(['plan', '--preset', 'qwen3-30b-a3b']) == 0\n"
              "print(' '.join(sorted(sys.modules)))")
    done = timeouts.run([sys.executable, "-c", script], 300, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.splitlines()[-1].split())
    assert "memfine.cli.plan" in loaded
    unwanted = {"memfine.train", "memfine.cli.train", "memfine.cli.bench", "memfine.cli.generate",
                "memfine.cli.evaluate", "memfine.cli.export", "memfine.suites", "memfine.bench",
                "memfine.artifacts", "memfine.reports"}
    assert not loaded & unwanted, sorted(loaded & unwanted)
