"""``memfine generate``, ``memfine eval``, ``memfine export`` on a trained run, and what they refuse
in one line (non-finite weights, an unwritable ``--to`` folder, a missing optional package);
``--config`` and ``--init-from`` of ``memfine train`` (memfine.cli.generate, evaluate, export,
train)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from memfine.cli.main import main
from memfine.data import encode
from memfine.inference.trained import load_safetensors, load_trained
from tolerances import LOSS_ATOL

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *FAST, "--max-steps", "4", "--sample-tokens", "0",
                 "--out", str(out)]) == 0
    return out


def test_eval_repeats_the_final_validation(run_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["eval", "--out", str(run_dir), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert got["step"] == 4
    assert abs(got["val_loss_nats_per_byte"] - summary["final_val_loss_nats_per_byte"]) \
        <= LOSS_ATOL
    assert got["val_loss_bits_per_byte"] == pytest.approx(
        got["val_loss_nats_per_byte"] / torch.log(torch.tensor(2.0)).item())


def test_eval_on_other_text(run_dir: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.txt"
    other.write_text("def f(x):\n    return x + 1\n" * 200)
    capsys.readouterr()
    assert main(["eval", "--out", str(run_dir), "--data", str(other)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint of step 4 on {other}" in out or "other.txt" in out
    with pytest.raises(SystemExit) as info:
        main(["eval", "--out", str(run_dir), "--data", str(tmp_path / "missing.txt")])
    assert info.value.code == 2


def test_eval_on_too_short_text_asks_only_for_longer_text(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_trained(run_dir).config
    short = tmp_path / "short.txt"
    short.write_text("x" * 10)
    err = _one_line_error(capsys, ["eval", "--out", str(run_dir), "--data", str(short)])
    assert (f"10 bytes are too few for the seq_len {config.seq_len} and val_fraction "
            f"{config.val_fraction} of the run's checkpoint") in err
    assert err.endswith(f"give a longer --data file (at least "
                        f"{math.ceil((config.seq_len + 1) / config.val_fraction)} bytes)"), err
    assert "--seq-len" not in err and "--val-fraction" not in err


def test_generate_is_seeded_and_continues_the_prompt(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    args = ["generate", "--out", str(run_dir), "--prompt", "def ", "--max-new-bytes", "40",
            "--temperature", "0.5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("def ")
    # the continuation is the model's own sample from the same generator seed
    trained = load_trained(run_dir)
    gen = torch.Generator().manual_seed(0)
    ids = trained.model.generate(encode("def ")[None], 40, temperature=0.5, generator=gen)
    assert first == bytes(ids[0].tolist()).decode("utf-8", errors="replace") + "\n"


@pytest.mark.parametrize(("args", "message"), [
    pytest.param(["--temperature", "-1"], "--temperature must be >= 0 (0: greedy decoding), "
                 "got -1.0", id="temperature"),
    pytest.param(["--max-new-bytes", "-1"], "--max-new-bytes must be in [0, 1000000], got -1",
                 id="bytes"),
    pytest.param(["--prompt", ""], "--prompt must hold at least one character", id="empty"),
    pytest.param(["--threads", "0"], "--threads must be >= 1, got 0", id="threads"),
])
def test_generate_bad_values(run_dir: Path, capsys: pytest.CaptureFixture[str],
                             args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--out", str(run_dir), "--prompt", "x", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["eval"], ["export"]],
                         ids=["generate", "eval", "export"])
def test_checkpoint_command_without_checkpoint_says_how_to_get_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """An empty run directory: the hint is the train command that fills it, not --resume."""
    with pytest.raises(SystemExit) as info:
        main([*command, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert (f"memfine {command[0]}: error: --out: no checkpoint at "
            f"'{tmp_path / 'checkpoint.pt'}' or '{tmp_path / 'checkpoint.dcp'}' (train into it "
            f"first: memfine train --out {tmp_path})\n") == err
    assert list(tmp_path.iterdir()) == []


def test_export_round_trips_the_logits(run_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "m.safetensors"
    assert main(["export", "--out", str(run_dir), "--to", str(target)]) == 0
    config = json.loads((tmp_path / "m_config.json").read_text())
    assert config["moe"]["num_experts"] == 4
    exported, trained = load_safetensors(target), load_trained(run_dir)
    ids = encode("class A:\n    pass\n")[None]
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained.model(ids).logits)
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(run_dir), "--to", str(target)])
    assert info.value.code == 2
    assert (target.stat().st_mode & 0o777) == ((run_dir / "config.json").stat().st_mode & 0o777)


def test_config_file_fills_flags_and_flags_win(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'preset = "tiny"\ndata = "{CORPUS}"\nmax_steps = 3\nnum_chunks = 2\n'
                    'bins = [1, 2]\nsample_tokens = 0\nno_progress = true\n')
    out = tmp_path / "run"
    assert main(["train", "--config", str(toml), "--max-steps", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["max_steps"] == 2  # the flag wins
    assert config["model"]["chunk"]["num_chunks"] == 2 and config["model"]["chunk"]["bins"] == [
        1, 2]


@pytest.mark.parametrize(("text", "message"), [
    pytest.param("max_step = 3\n", "unknown key 'max_step'", id="unknown_key"),
    pytest.param("max_steps = 'many'\n", "max_steps: expected an integer, got 'many'",
                 id="bad_value"),
    pytest.param("plot = 1\n", "plot must be true or false", id="bad_switch"),
    pytest.param("max_steps = \n", "is not valid TOML", id="bad_toml"),
])
def test_config_file_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         text: str, message: str) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--config", str(toml), "--out", str(tmp_path / "run")])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_init_from_takes_the_model_of_the_checkpoint(run_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tuned"
    assert main(["train", "--data", CORPUS, "--no-progress", "--threads", "1", "--max-steps",
                 "1", "--sample-tokens", "0", "--init-from", str(run_dir),
                 "--out", str(out)]) == 0
    # the small preset's other settings, the tiny checkpoint's model
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == json.loads((run_dir / "config.json").read_text())["model"]
    assert config["batch_size"] == 32
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--init-from", str(run_dir), "--out", str(run_dir)])
    assert info.value.code == 2
    assert "--init-from starts another run than the checkpoint in" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "message"), [
    pytest.param("missing", "--init-from '{path}' does not exist; --init-from takes the run "
                 "directory of memfine train", id="missing_directory"),
    pytest.param("empty", "--init-from: no checkpoint at '{path}/checkpoint.pt' or "
                 "'{path}/checkpoint.dcp' (--init-from takes the --out of a memfine train run "
                 "that has saved a checkpoint)", id="empty_directory"),
])
def test_init_from_without_checkpoint_names_init_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, message: str) -> None:
    """No checkpoint at --init-from: the message is about --init-from (no --resume was given)."""
    source = tmp_path / name
    if name == "empty":
        source.mkdir()
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--init-from", str(source), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert message.format(path=source) in err and "--resume" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["eval"], ["generate", "--prompt", "x", "--max-new-bytes",
                                                 "2"]])
def test_checkpoint_commands_run_on_the_threads_asked_for(run_dir: Path, command: list[str]
                                                          ) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main([*command, "--out", str(run_dir), "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)



@pytest.mark.parametrize("name", ["checkpoint.pt", "config.json", "metrics.jsonl"])
def test_export_never_writes_over_the_runs_own_files(run_dir: Path, name: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = (run_dir / name).read_bytes()
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(run_dir), "--to", str(run_dir / name), "--overwrite"])
    assert info.value.code == 2
    assert "is a file of the run in --out" in capsys.readouterr().err
    assert (run_dir / name).read_bytes() == before


def test_export_refuses_a_target_that_is_no_regular_file(run_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    target = tmp_path / "model.safetensors"
    target.mkdir()
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(run_dir), "--to", str(target), "--overwrite"])
    assert info.value.code == 2
    assert "exists and is not a regular file" in capsys.readouterr().err
    assert target.is_dir()


@pytest.mark.parametrize("exists", [False, True])
def test_export_to_a_folder_with_its_slash_is_refused(run_dir: Path, tmp_path: Path, exists: bool,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--to DIR/`` names a folder, there or not: nothing is written as DIR or DIR_config.json."""
    folder = tmp_path / "exports"
    if exists:
        folder.mkdir()
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(run_dir), "--to", f"{folder}/"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert "--to: expected the path of" in err and f"got '{folder}/': a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["exports"] if exists else [])


def test_generate_bounds_the_bytes_asked_for(run_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--out", str(run_dir), "--prompt", "x", "--max-new-bytes",
              str(10**18)])
    assert info.value.code == 2
    assert "--max-new-bytes must be in [0, 1000000]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # beyond int64: refused as the flag is parsed
        main(["generate", "--out", str(run_dir), "--prompt", "x", "--max-new-bytes",
              str(10**20)])
    assert info.value.code == 2
    assert "argument --max-new-bytes: expected an integer in" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train", "--config"], ["plan", "--hf-config"]])
def test_a_fifo_as_a_config_file_is_refused_without_blocking(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit) as info:  # opening the FIFO would block forever
        main([*command, str(fifo), "--out", str(tmp_path / "run")] if command[0] == "train"
             else [*command, str(fifo)])
    assert info.value.code == 2
    assert "is not a regular file" in capsys.readouterr().err


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _damaged_copy(run_dir: Path, copy: Path, name: str,
                  damage: Callable[[torch.Tensor], object]) -> Path:
    """``run_dir`` copied to ``copy``, ``damage`` applied in place to weight ``name``."""
    shutil.copytree(run_dir, copy)
    payload = torch.load(copy / "checkpoint.pt", weights_only=True)
    damage(payload["model"][name])
    torch.save(payload, copy / "checkpoint.pt")
    return copy


@pytest.mark.parametrize("command", [["generate", "--prompt", "def "], ["eval"], ["export"]])
def test_a_checkpoint_with_non_finite_weights_is_refused(
        run_dir: Path, tmp_path: Path, command: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    nan_run = _damaged_copy(run_dir, tmp_path / "nan", "blocks.0.moe.experts.w_down",
                            lambda w: w.view(-1)[0].fill_(float("nan")))
    err = _one_line_error(capsys, [command[0], "--out", str(nan_run), *command[1:]])
    assert f"checkpoint '{nan_run / 'checkpoint.pt'}' holds non-finite weights (1 of " in err
    assert "blocks.0.moe.experts.w_down" in err
    assert not (nan_run / "model.safetensors").exists()


def test_resuming_a_checkpoint_with_non_finite_weights_is_refused(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nan_run = _damaged_copy(run_dir, tmp_path / "nan", "blocks.0.moe.experts.w_down",
                            lambda w: w.view(-1)[0].fill_(float("nan")))
    before = {p.name: p.read_bytes() for p in nan_run.iterdir() if p.is_file()}
    err = _one_line_error(capsys, ["train", *FAST, "--max-steps", "6", "--sample-tokens", "0",
                                   "--resume", "--out", str(nan_run)])
    assert f"checkpoint '{nan_run / 'checkpoint.pt'}' holds non-finite weights (1 of " in err
    assert "blocks.0.moe.experts.w_down" in err and "diverged at step" not in err
    assert {p.name: p.read_bytes() for p in nan_run.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("command", [["generate", "--prompt", "def "], ["eval"]])
def test_finite_weights_whose_outputs_overflow_are_one_line(
        run_dir: Path, tmp_path: Path, command: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    huge = _damaged_copy(run_dir, tmp_path / "huge", "norm.weight",  # finite; logits overflow
                         lambda w: w.fill_(3e38))
    err = _one_line_error(capsys, [command[0], "--out", str(huge), *command[1:]])
    assert "of the checkpoint of step 4" in err or "the checkpoint of step 4 gives" in err
    assert "its weights are finite but its outputs overflow" in err


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder no file can be created in: one without write permission, or (root ignores
    permissions) sysfs, where nobody can create files."""
    if os.geteuid() == 0:
        if not Path("/sys/kernel").is_dir():
            pytest.skip("running as root without sysfs: no folder refuses a new file")
        yield Path("/sys")
        return
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_export_to_a_read_only_folder_names_the_folder(
        run_dir: Path, read_only_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(read_only_folder.iterdir())
    err = _one_line_error(capsys, ["export", "--out", str(run_dir), "--to",
                                   str(read_only_folder / "m.safetensors")])
    assert f"the folder '{read_only_folder}' is not writable" in err and ".tmp" not in err
    assert sorted(read_only_folder.iterdir()) == before


def test_export_without_safetensors_names_an_extra_that_exists(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as when not installed
    err = _one_line_error(capsys, ["export", "--out", str(run_dir), "--to",
                                   str(tmp_path / "m.safetensors")])
    assert "pip install 'memfine[train]'" in err
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert any(dep.startswith("safetensors")
               for dep in pyproject["project"]["optional-dependencies"]["train"])


def test_export_again_names_what_was_given_and_says_what_overwrite_replaced(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert main(["export", "--out", str(run)]) == 0
    assert "--overwrite" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(run)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memfine export: error: the export of --out {str(run)!r} (no --to "
                          f"given): {run / 'model.safetensors'}, ") and "--to:" not in err
    assert "pass --overwrite to replace them" in err
    assert main(["export", "--out", str(run), "--overwrite"]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"(--overwrite replaced the earlier {run / 'model.safetensors'}, "
        f"{run / 'model_config.json'})")
