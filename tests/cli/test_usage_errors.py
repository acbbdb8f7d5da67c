"""Bad input on the command line ends as one line naming the flag, exit 2, before anything big.

Each test covers a kind of input: sizes too large for the machine, paths that are files, devices
or folders where the other is needed, numbers outside what the flag's type holds, text that is no
UTF-8, a changed flag on ``--resume``, model flags that contradict ``--init-from``, and the
memory-budget messages in the flags' words.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import sys
from pathlib import Path

import pytest
import torch
from ep_harness import free_port

import timeouts
from memfine.cli import train as train_cli
from memfine.cli.bench import _BUDGET_NAMES
from memfine.cli.main import _path_flag, build_parser, main
from memfine.flags import threads
from memfine.nn import MoETransformerLM
from memfine.reports import memory_log
from memfine.schedule.decision import CONFIG_NAMES, InfeasibleBudgetError
from memfine.schedule.wording import flag_words
from memfine.train import preset

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1",
        "--max-steps", "1", "--eval-batches", "1", "--sample-tokens", "0"]
GIB = 2**30


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``memfine argv``; assert exit 2 with one line and no traceback; return the line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *FAST, "--out", str(out)]) == 0
    return out


# -- sizes: the memory check runs before the model exists ------------------------------------


@pytest.mark.parametrize("flag,value", [("--seq-len", "100000000"), ("--num-layers", "100000"),
                                        ("--hidden-size", "1000000"),
                                        ("--batch-size", "9223372036854775807"),
                                        ("--grad-accum", "1000000000000"),
                                        ("--num-experts", "9223372036854775807")])
def test_huge_sizes_are_refused_before_anything_is_allocated(
        tmp_path: Path, flag: str, value: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_log, "available_bytes", lambda device: 16 * GIB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    line = _usage_error(["train", *FAST, flag, value, "--out", str(tmp_path / "r")], capsys)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert f"{flag} {value}" in line and "16.00 GiB free on cpu" in line
    assert grown < GIB  # the RoPE tables of --seq-len 1e8 alone were 12.9 GB
    assert not (tmp_path / "r").exists()


def test_parameter_count_matches_the_built_model_without_building_every_block() -> None:
    config = preset("tiny")
    for layers in (1, 3):
        sized = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                       num_layers=layers))
        built = sum(p.numel() for p in MoETransformerLM(sized.model).parameters())
        assert memory_log.num_parameters(sized) == built
    one = memory_log.num_parameters(dataclasses.replace(
        config, model=dataclasses.replace(config.model, num_layers=1)))
    three = memory_log.num_parameters(dataclasses.replace(
        config, model=dataclasses.replace(config.model, num_layers=3)))
    huge = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 num_layers=10**6))
    assert memory_log.num_parameters(huge) == one + (10**6 - 1) * (three - one) // 2


def test_a_long_context_allocates_no_position_tables() -> None:
    config = preset("tiny").model
    long = MoETransformerLM(dataclasses.replace(config, max_seq_len=10**8))
    assert all(b.numel() < 10**6 for b in long.buffers())
    short = MoETransformerLM(dataclasses.replace(config, max_seq_len=16))
    short.load_state_dict(long.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(long(ids).logits, short(ids).logits, rtol=0, atol=0)


# -- the memory check under torchrun: each rank against its share ----------------------------


def _rank_check(monkeypatch: pytest.MonkeyPatch, *, free: int, params: int, predicted: int,
                local: int) -> list[tuple[int, int]]:
    """Run ``_check_memory_fits`` as rank 1 of 2 with fixed numbers; returns its calls."""
    calls: list[tuple[int, int]] = []

    def predict(config: object, total_parameters: int, num_tokens: int) -> int:
        calls.append((total_parameters, num_tokens))
        return predicted

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setattr(memory_log, "available_bytes", lambda device: free)
    monkeypatch.setattr(memory_log, "num_parameters", lambda config: params)
    monkeypatch.setattr(memory_log, "predicted_run_bytes", predict)
    train_cli._check_memory_fits(preset("tiny"), 2)
    return calls


def test_each_torchrun_rank_checks_its_share_of_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = preset("tiny")
    mib = 2**20
    # one rank per host: 600 MiB predicted fit 1000 MiB free; the shard is half the parameters
    calls = _rank_check(monkeypatch, free=1000 * mib, params=100, predicted=600 * mib, local=1)
    assert calls == [(50, tiny.batch_size // 2 * tiny.seq_len)]
    # two ranks on the host: each has 500 of the 1000 MiB
    with pytest.raises(ValueError, match=r"500\.00 MiB share of each of the 2 ranks of this "
                                         r"host's free memory \(rank 1 of 2\)"):
        _rank_check(monkeypatch, free=1000 * mib, params=100, predicted=600 * mib, local=2)
    # each rank first builds the whole model: 2**28 fp32 parameters are 1 GiB
    with pytest.raises(ValueError, match=r"needs about 1\.00 GiB"):
        _rank_check(monkeypatch, free=1000 * mib, params=2**28, predicted=mib, local=1)


def test_torchrun_ranks_refuse_before_any_process_group(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(memory_log, "available_bytes", lambda device: 16 * GIB)
    line = _usage_error(["train", *FAST, "--hidden-size", "100000", "--out",
                         str(tmp_path / "r")], capsys)
    assert "8.00 GiB share of each of the 2 ranks" in line and "(rank 0 of 2)" in line
    monkeypatch.setenv("RANK", "1")  # raised on every rank, printed by rank 0 alone
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--hidden-size", "100000", "--out", str(tmp_path / "r")])
    assert info.value.code == 2
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("argv", [["train", "--max-steps", "abc"], ["train", "--nope"],
                                  ["--seed", "1", "bench"]])
def test_a_flag_error_is_printed_by_rank_0_alone(argv: list[str],
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    assert _usage_error(argv, capsys).startswith("memfine")
    monkeypatch.setenv("RANK", "1")  # the same argv on every torchrun rank: one line in all
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr() == ("", "")


@pytest.mark.distributed
def test_torchrun_ranks_each_refuse_a_run_too_large(tmp_path: Path) -> None:
    """Under a real torchrun with two CPU ranks, both refuse before any process group exists;
    rank 0 prints the line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "memfine",
           "train", *FAST, "--hidden-size", "100000", "--out", str(tmp_path / "r")]
    proc = timeouts.run(cmd, 300, cwd=tmp_path, capture_output=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert re.search(r"memfine train: error: the run needs about [\d.]+ GiB per step .* "
                     r"share of each of the 2 ranks of this host's free memory \(rank 0 of 2\)",
                     proc.stdout + proc.stderr)
    assert (proc.stdout + proc.stderr).count("memfine train: error:") == 1
    assert "Traceback" not in proc.stdout and not (tmp_path / "r").exists()


# -- paths: files, devices and folders where the other is needed ----------------------------


def test_path_flags_that_name_no_usable_path(tmp_path: Path, run_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    folder = tmp_path / "folder"
    folder.mkdir()
    out = ["--out", str(tmp_path / "r")]
    cases = [
        (["train", *FAST, "--out", "/dev/null/x"], "--out '/dev/null/x'"),
        (["train", *FAST, "--out", "/dev/null"], "--out '/dev/null' is not a directory"),
        (["train", *FAST, "--out", str(file / "x")], "which is not a directory"),
        (["train", *FAST, "--config", str(folder), *out], "--config"),
        (["train", *FAST, "--config", str(file / "x"), *out], "--config"),
        (["train", *FAST, "--data", str(file / "x"), *out], "--data"),
        (["train", *FAST, "--init-from", str(file / "x"), *out], "--init-from"),
        (["train", *FAST, "--init-from", "/dev/null", *out], "--init-from '/dev/null' is not"),
        (["train", *FAST, "--resume", "--out", str(file / "x")], "--out"),
        (["eval", "--out", str(run_dir), "--data", str(file / "x")], "--data"),
        (["generate", "--out", "/dev/null", "--prompt", "a"], "--out '/dev/null' is not"),
        (["export", "--out", str(run_dir), "--to", str(folder), "--overwrite"], "--to"),
        (["export", "--out", str(run_dir), "--to", str(file / "x"), "--overwrite"], "--to"),
        (["export", "--out", str(run_dir), "--to", "/dev/null/x"], "--to"),
    ]
    for argv, named in cases:
        line = _usage_error(argv, capsys)
        assert named in line, (argv, line)
    assert not (tmp_path / "r").exists() and file.read_text() == "x"
    assert list(folder.iterdir()) == []


def test_an_os_error_on_a_typed_path_names_its_flag(tmp_path: Path) -> None:
    args = argparse.Namespace(command="train", out=tmp_path / "run", data="pydoc",
                              _run=None)
    err = NotADirectoryError(20, "Not a directory", str(tmp_path / "run" / "config.json"))
    assert _path_flag(args, err) == f"--out {str(tmp_path / 'run')!r}"
    assert _path_flag(args, NotADirectoryError(20, "x", "/elsewhere/file")) is None


def test_empty_values_are_refused_and_shown(run_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An empty value (an unset shell variable) never means the current directory or a default."""
    out = ["--out", str(tmp_path / "r")]
    cases = [
        (["eval", "--out", str(run_dir), "--data", ""], "argument --data: expected a value, "
                                                        "got ''"),
        (["train", *FAST, "--data", " ", *out], "argument --data: expected a value, got ' '"),
        (["train", *FAST, "--config", "", *out], "argument --config: expected the path of a "
                                                 "TOML file of flag values, got '' (see"),
        (["export", "--out", str(run_dir), "--to", " "], "argument --to: expected the path of "
                                                         "the safetensors file to write, got ' ' "
                                                         "(see"),
        (["train", *FAST, "--out", ""], "argument --out: expected a path, got '' (for the "
                                        "current directory give '.')"),
        (["train", *FAST, "--device", "", *out], "--device must be 'cpu' or 'cuda[:i]', got ''"),
        (["bench", "--quick", "--out", ""], "argument --out: expected a path, got ''"),
    ]
    for argv, expected in cases:
        assert expected in _usage_error(argv, capsys)
    assert not (tmp_path / "r").exists()


def test_a_tilde_in_a_path_flag_is_the_home_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out=~/run`` (no shell expansion after '=') writes under $HOME, not into './~'."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", *FAST, "--out=~/run"]) == 0
    assert (tmp_path / "home" / "run" / "checkpoint.pt").is_file()
    assert not (tmp_path / "~").exists()


# -- numbers: int flags hold int64, float flags are finite -----------------------------------


def _actions(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(f"{name} {a.option_strings[0]}", a) for a in sub._actions
                        if a.option_strings]
    return out


def test_no_flag_parses_with_plain_int_or_float() -> None:
    actions = _actions(build_parser())
    plain = [name for name, action in actions if action.type in (int, float)]
    assert plain == []
    commands = {name.split()[0] for name, _ in actions}
    assert commands == {"train", "generate", "eval", "export", "plan", "bench"}


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--seed", "1e23"], "--seed"),
    (["generate", "--seed", str(10**23)], "--seed"),
    (["generate", "--max-new-bytes", str(-(10**30))], "--max-new-bytes"),
    (["train", "--seed", str(2**63)], "--seed"),
    (["train", "--save-every", str(10**30)], "--save-every"),
    (["train", "--bins", f"1,{10**30}"], "--bins"),
    (["bench", "--tokens", str(10**30)], "--tokens"),
    (["bench", "--hidden-size", "1e23"], "--hidden-size"),
    (["bench", "--seed", "1.5"], "--seed"),
    (["plan", "--hidden-size", "1e23"], "--hidden-size"),
    (["plan", "--num-layers", str(-(10**30))], "--num-layers"),
    (["plan", "--micro-batch", str(2**63)], "--micro-batch"),
    (["plan", "--search", "--devices", "1e3"], "--devices"),
    (["plan", "--top", "5.0"], "--top"),
    (["plan", "--preset", "qwen3-30b-a3b", "--alpha", "nan"], "--alpha"),
    (["generate", "--temperature", "inf"], "--temperature"),
    (["generate", "--temperature", "nan"], "--temperature"),
    (["train", "--lr", "inf"], "--lr"),
    (["train", "--lora-alpha", "nan"], "--lora-alpha"),
    (["train", "--capacity-factor", "-inf"], "--capacity-factor"),
])
def test_numbers_outside_the_flag_type_name_the_flag(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(argv, capsys)
    assert line.startswith(f"memfine {argv[0]}: error: argument {flag}: expected")


def test_a_prompt_that_is_no_utf8_names_the_flag(run_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    prompt = b"ab\xff".decode("utf-8", "surrogateescape")  # what a bytes argv gives Python
    line = _usage_error(["generate", "--out", str(run_dir), "--prompt", prompt], capsys)
    assert "--prompt must be UTF-8 text; it holds byte 0xff at character 2" in line


def test_more_threads_than_cpus_are_lowered_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.clamp_threads(3) == 3 and capsys.readouterr().err == ""
    assert threads.clamp_threads(1000) == 4
    assert capsys.readouterr().err == ("warning: --threads 1000 is more than the 4 CPU(s) this "
                                       "process may use; using 4\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert threads.clamp_threads(1000) == 1
    assert "shared by 3 local ranks; using 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        threads.clamp_threads(0)


# -- resume and init-from name the flag that changed -----------------------------------------


def test_resume_names_the_changed_flag_with_both_values(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lr = preset("tiny").lr
    for extra in ([], ["--preset", "tiny"]):
        line = _usage_error(["train", *FAST, *extra, "--resume", "--max-steps", "2", "--lr",
                             "0.5", "--out", str(run_dir)], capsys)
        assert line.endswith(f"--lr cannot change on --resume (the checkpoint in "
                             f"{str(run_dir)!r} has --lr {lr!r}, got 0.5)")
    line = _usage_error(["train", *FAST, "--preset", "small", "--resume", "--max-steps", "2",
                         "--out", str(run_dir)], capsys)
    assert "--preset starts another run" in line and "--hidden-size 64 -> 128" in line


def _resolved(argv: list[str]) -> object:
    args = build_parser().parse_args(["train", *argv])
    return train_cli.resolve_config(args)[0]


def test_init_from_keeps_the_source_architecture(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = preset("tiny").model
    out = ["--out", str(tmp_path / "r")]
    # the default preset is small; the model is the tiny source's, chunking is this run's own
    config = _resolved(["--init-from", str(run_dir), "--num-chunks", "2", *out])
    assert config.model == dataclasses.replace(  # type: ignore[attr-defined]
        source, chunk=dataclasses.replace(source.chunk, num_chunks=2))
    for flag, value in (("--hidden-size", "32"), ("--num-layers", "3"), ("--top-k", "1")):
        line = _usage_error(["train", *FAST, "--init-from", str(run_dir), flag, value, *out],
                            capsys)
        assert line.startswith(f"memfine train: error: {flag} {value} cannot change the model "
                               f"of --init-from {str(run_dir)!r}")
    assert main(["train", *FAST, "--init-from", str(run_dir), "--num-chunks", "2", *out]) == 0


# -- budget messages in the flags' words ----------------------------------------------------


@pytest.mark.parametrize("scope", ["layer", "step"])
def test_over_budget_warnings_name_the_flags(tmp_path: Path, scope: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *FAST, "--memory-budget", "1KiB", "--allow-over-budget",
                 "--budget-scope", scope, "--out", str(tmp_path / "r")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--memory-budget" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: --memory-budget 1024 bytes")
    assert "ChunkConfig" not in warnings[0] and "(--allow-over-budget)" in warnings[0]


def test_bench_budget_errors_name_its_flag() -> None:
    err = InfeasibleBudgetError(1024, 4096, (1, 2, 4, 8), "the layer needs more")
    text = flag_words(str(err), _BUDGET_NAMES)
    assert CONFIG_NAMES["budget"] not in text and "ChunkConfig" not in text
    assert text.startswith("--memory-budget 1024 bytes") and text.endswith(
        "; raise --memory-budget")  # bench has no --bins and no --allow-over-budget
    assert "--bins" not in text and "add a larger bin" not in text


def test_a_byte_size_above_int64_names_its_flag(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["train", *FAST, "--memory-budget", "99999999999999TiB", "--out",
                         str(tmp_path / "r")], capsys)
    assert "--memory-budget" in line and "above the largest size" in line
    line = _usage_error(["plan", "--device-memory", "99999999999999999TiB"], capsys)
    assert "--device-memory" in line and "above the largest size" in line


def test_init_from_into_its_own_directory_is_refused(run_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = (run_dir / "checkpoint.pt").read_bytes()
    line = _usage_error(["train", *FAST, "--init-from", str(run_dir), "--out", str(run_dir),
                         "--overwrite"], capsys)
    assert "--init-from and --out are the same directory" in line
    assert (run_dir / "checkpoint.pt").read_bytes() == before


def test_bench_sizes_beyond_the_machine_are_refused_before_any_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b"
    line = _usage_error(["bench", "--suites", "counts", "--quick", "--num-experts",
                         "9223372036854775807", "--out", str(out)], capsys)
    assert line.startswith("memfine bench: error: --num-experts 9223372036854775807: one layer")
    assert not out.exists()
