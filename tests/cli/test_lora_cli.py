"""``memfine train --lora-rank``, and eval, generate and export on a LoRA run (memfine.cli)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from memfine.cli.main import main
from memfine.data import encode
from memfine.inference.adapters import load_adapters
from memfine.inference.trained import load_safetensors, load_trained
from memfine.reports.metrics import read_metrics
from memfine.train import load_checkpoint
from memfine.train.loop import _written
from tolerances import LOSS_ATOL, assert_close

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1",
        "--sample-tokens", "0"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base")
    assert main(["train", *FAST, "--max-steps", "3", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tuned(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tuned")
    assert main(["train", *FAST, *LORA, "--max-steps", "4", "--init-from", str(base),
                 "--out", str(out)]) == 0
    return out


def test_lora_run_trains_adapters_on_the_frozen_base(base: Path, tuned: Path) -> None:
    config = json.loads((tuned / "config.json").read_text())
    assert config["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                              "targets": ["w_up", "w_down"], "train_router": False,
                              "train_attention": False}
    before = load_checkpoint(base / "checkpoint.pt")["model"]
    after = load_checkpoint(tuned / "checkpoint.pt")
    whole = load_trained(tuned).model.state_dict()  # the frozen base read from the base run
    assert all(torch.equal(whole[k], v) for k, v in before.items())
    assert sorted(set(after["model"]) - set(before)) == sorted(
        f"blocks.{i}.moe.experts.lora_{ab}_{w}" for i in range(2) for ab in "ab"
        for w in ("up", "down"))
    assert set(after["model"]) & set(before) <= {k for k in before if "selection_bias" in k}
    assert after["base"]["checkpoint"] == str((base / "checkpoint.pt").resolve())
    assert len(after["optimizer"]["state"]) == 8  # AdamW moments of the adapters only
    losses = [r["train_loss"] for r in read_metrics(tuned / "metrics.jsonl")]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))


def test_resume_of_a_lora_run_equals_the_straight_run(base: Path, tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [*FAST, *LORA, "--lora-dropout", "0.1", "--init-from", str(base)]
    assert main(["train", *common, "--max-steps", "4", "--out", str(straight)]) == 0
    assert main(["train", *common, "--max-steps", "2", "--lr-decay-steps", "4",
                 "--out", str(split)]) == 0
    assert main(["train", "--resume", "--max-steps", "4", "--out", str(split),
                 "--no-progress", "--threads", "1"]) == 0
    got = [r["train_loss"] for r in read_metrics(split / "metrics.jsonl")]
    want = [r["train_loss"] for r in read_metrics(straight / "metrics.jsonl")]
    assert len(got) == len(want) == 4
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOSS_ATOL


def test_resume_names_an_older_export(base: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """After --resume the end-of-run file list says which exported files are older."""
    out = tmp_path / "run"
    assert main(["train", *FAST, *LORA, "--max-steps", "1", "--init-from", str(base),
                 "--out", str(out)]) == 0
    assert main(["export", "--out", str(out), "--overwrite"]) == 0
    assert main(["train", "--resume", "--max-steps", "2", "--out", str(out),
                 "--no-progress", "--threads", "1"]) == 0
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: ")
    assert "adapters.safetensors (exported at step 1, not step 2: export again)" in done, done
    assert main(["export", "--out", str(out), "--overwrite"]) == 0  # now at step 2
    assert "adapters.safetensors" in _written(out, 2)


def test_eval_and_generate_use_the_adapters(tuned: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["eval", "--out", str(tuned), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    summary = json.loads((tuned / "summary.json").read_text())
    assert abs(got["val_loss_nats_per_byte"] - summary["final_val_loss_nats_per_byte"]) \
        <= LOSS_ATOL
    assert main(["generate", "--out", str(tuned), "--prompt", "def ", "--max-new-bytes",
                 "16", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    trained = load_trained(tuned)
    ids = trained.model.generate(encode("def ")[None], 16, temperature=0.0,
                                 generator=torch.Generator().manual_seed(0))
    assert out == bytes(ids[0].tolist()).decode("utf-8", errors="replace") + "\n"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(encode("def f(x):\n    return x")[None]).logits


def test_export_writes_the_adapters_and_the_merged_model(
        base: Path, tuned: Path, tmp_path: Path) -> None:
    want = _logits(load_trained(tuned).model)
    assert main(["export", "--out", str(tuned), "--to", str(tmp_path / "adapters.safetensors")
                 ]) == 0
    assert main(["export", "--out", str(base), "--to", str(tmp_path / "base.safetensors")]) == 0
    model = load_safetensors(tmp_path / "base.safetensors")
    lora = load_adapters(model, tmp_path / "adapters.safetensors")
    assert lora.rank == 4 and lora.alpha == 8.0
    assert torch.equal(_logits(model.eval()), want)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapters.safetensors"), framework="pt") as f:
        assert all(".lora_" in key for key in f.keys())  # noqa: SIM118 (not a dict)
        names = list(f.keys())  # noqa: SIM118 (not a dict)
    assert len(names) == 8 and "blocks.0.moe.experts.lora_a_up" in names
    assert main(["export", "--out", str(tuned), "--merged",
                 "--to", str(tmp_path / "merged.safetensors")]) == 0
    merged = load_safetensors(tmp_path / "merged.safetensors")
    assert_close(_logits(merged), want)


def test_lora_resume_and_init_from_a_lora_run(base: Path, tuned: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A LoRA run as --init-from gives its merged weights; a second LoRA starts on them."""
    out = tmp_path / "again"
    assert main(["train", *FAST, "--lora-rank", "2", "--max-steps", "1", "--init-from",
                 str(tuned), "--out", str(out)]) == 0
    trained = load_trained(tuned)
    merged = load_trained(out)
    from memfine.inference.adapters import merged as merge

    plain = merge(trained).model.state_dict()
    state = merged.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.items())


BAD = [
    pytest.param(lambda b: ["--lora-rank", "4"], "--lora-rank needs --init-from RUN",
                 id="rank_without_init_from"),
    pytest.param(lambda b: ["--lora-rank", "0", "--init-from", str(b)],
                 "--lora-rank must be >= 1, got 0", id="rank0"),
    pytest.param(lambda b: ["--lora-rank", "65", "--init-from", str(b)],
                 "--lora-rank must be in [1, min(d_in, d_out)=64] (w_up: d_in=64, d_out=128, "
                 "w_down: d_in=64, d_out=64), got 65", id="rank_above_min_d_in_d_out"),
    pytest.param(lambda b: ["--lora-alpha", "4", "--init-from", str(b)],
                 "--lora-alpha needs --lora-rank", id="alpha_without_rank"),
    pytest.param(lambda b: ["--lora-rank", "2", "--lora-alpha", "0", "--init-from", str(b)],
                 "--lora-alpha must be > 0, got 0.0", id="alpha0"),
    pytest.param(lambda b: ["--lora-rank", "2", "--lora-dropout", "1", "--init-from", str(b)],
                 "--lora-dropout must be in [0.0, 1.0), got 1.0", id="dropout1"),
    pytest.param(lambda b: ["--lora-rank", "2", "--lora-targets", "w_gate", "--init-from",
                            str(b)], "--lora-targets must be a non-empty subset of ('w_up', "
                 "'w_down'), got w_gate", id="unknown_target"),
    pytest.param(lambda b: ["--lora-rank", "2", "--lora-targets", "w_up,w_up", "--init-from",
                            str(b)], "--lora-targets must be a subset of ('w_up', 'w_down') "
                 "without duplicates, got w_up,w_up$", id="duplicate_target"),
    *(pytest.param(lambda b, v=v: ["--lora-rank", "2", "--lora-targets", v, "--init-from",
                                   str(b)], f"argument --lora-targets: expected a non-empty "
                   f"comma-separated subset of w_up, w_down, got {v!r} (", id=f"no_target{i}")
      for i, v in enumerate([",", "", " , ,"])),
]


@pytest.mark.parametrize(("make_args", "message"), BAD)
def test_bad_lora_input_is_one_line_exit_2(base: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], make_args,
                                           message: str) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--out", str(out), *make_args(base)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    if message.endswith("$"):  # the whole message
        assert err == f"memfine train: error: {message[:-1]}"
    assert err.startswith(f"memfine train: error: {message.rstrip('$')}") and "\n" not in err
    assert not out.exists()


def test_lora_flags_on_resume(base: Path, tuned: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    for run_dir, args, message in [
            (tuned, ["--lora-rank", "8"], f"--lora-rank cannot change on --resume (the "
             f"checkpoint in '{tuned}' has --lora-rank 4, got 8)"),
            (base, ["--lora-rank", "4"], f"--lora-rank cannot change on --resume (the "
             f"checkpoint in '{base}' trains every weight, without LoRA adapters)")]:
        with pytest.raises(SystemExit) as info:
            main(["train", "--resume", "--out", str(run_dir), "--max-steps", "9", *args])
        assert info.value.code == 2
        assert capsys.readouterr().err.strip() == f"memfine train: error: {message}"


def test_resume_refuses_another_init_from(base: Path, tuned: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """--resume keeps the checkpoint's frozen base: another --init-from run is a usage error."""
    other, again = tmp_path / "other", tmp_path / "again"
    shutil.copytree(base, other)  # another base run directory
    assert main(["train", "--resume", "--max-steps", "4", "--out", str(other), "--no-progress",
                 "--threads", "1"]) == 0  # ... with other weights
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, *LORA, "--resume", "--max-steps", "9", "--init-from", str(other),
              "--out", str(tuned)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"memfine train: error: --init-from cannot change on --resume (the checkpoint in "
        f"'{tuned}' has --init-from '{base.resolve()}', the frozen base of its LoRA adapters, "
        f"got '{other.resolve()}')")
    # the original command repeated with --resume passes (the same directory, spelled otherwise)
    shutil.copytree(tuned, again)
    assert main(["train", *FAST, *LORA, "--resume", "--max-steps", "5", "--init-from",
                 str(base / ".." / base.name), "--out", str(again)]) == 0
    assert load_checkpoint(again / "checkpoint.pt")["step"] == 5


def test_resume_with_another_preset_and_init_from_names_both(
        base: Path, tuned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *LORA, "--resume", "--preset", "small", "--init-from", str(base),
              "--max-steps", "9", "--out", str(tuned)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"memfine train: error: --preset and --init-from start another run "
                          f"than the checkpoint in '{tuned}' (checkpoint -> --preset and "
                          f"--init-from: ")
    assert err.endswith("drop --preset and --init-from, or give the original ones and the "
                        "original command's flags for the fields above")


def test_resume_with_the_original_preset_names_a_missing_lora_flag(
        tuned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the run was made with --preset tiny --lora-rank 4 ...; --lora-rank left out on resume
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", *FAST, "--max-steps", "9", "--out", str(tuned)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"memfine train: error: --preset starts another run than the "
                          f"checkpoint in '{tuned}' (checkpoint -> --preset: --lr 0.01 -> 0.003, "
                          f"--warmup-steps 1 -> 10, --lora-rank 4 -> unset, "), err
    assert err.endswith("drop --preset, or give the original one and the original command's "
                        "flags for the fields above")


def test_export_merged_needs_a_lora_run(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(base), "--merged"])
    assert info.value.code == 2
    assert "--merged needs a LoRA run (trained with --lora-rank)" in capsys.readouterr().err


def test_resume_compares_lora_flags_as_the_flags_take_them(tuned: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    run = tmp_path / "run"
    shutil.copytree(tuned, run)
    resume = ["train", "--resume", "--out", str(run), "--max-steps", "5", "--no-progress",
              "--threads", "1"]
    assert main([*resume, "--lora-targets", "w_down,w_up"]) == 0  # the same set: no change
    for args, shown in [(["--lora-targets", "w_up"], "--lora-targets w_up,w_down, got w_up"),
                        (["--lora-train-router"], "--lora-train-router off, got on")]:
        with pytest.raises(SystemExit) as info:
            main([*resume, *args])
        assert info.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"memfine train: error: {args[0]} cannot change on --resume (the checkpoint in "
            f"'{run}' has {shown})")


def test_a_lora_run_stays_usable_after_its_base_run_resumes_and_is_deleted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert main(["train", *FAST, "--max-steps", "2", "--out", str(base)]) == 0
    assert main(["train", *FAST, *LORA, "--max-steps", "2", "--init-from", str(base),
                 "--out", str(tuned)]) == 0
    capsys.readouterr()
    assert main(["eval", "--out", str(tuned), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["train", *FAST, "--max-steps", "3", "--resume", "--out", str(base)]) == 0
    for step in ("resumed", "deleted"):
        capsys.readouterr()
        assert main(["eval", "--out", str(tuned), "--json"]) == 0, step
        assert json.loads(capsys.readouterr().out) == before, step  # the same base, bitwise
        assert main(["generate", "--out", str(tuned), "--prompt", "def ",
                     "--max-new-bytes", "8"]) == 0, step
        assert main(["export", "--out", str(tuned), "--overwrite"]) == 0, step
        assert main(["export", "--out", str(tuned), "--merged", "--overwrite"]) == 0, step
        shutil.rmtree(base, ignore_errors=True)
    assert main(["train", "--resume", "--max-steps", "3", "--out", str(tuned),
                 "--no-progress", "--threads", "1"]) == 0
    assert load_checkpoint(tuned / "checkpoint.pt")["step"] == 3
    # the original command repeated, naming the deleted base run
    assert main(["train", *FAST, *LORA, "--max-steps", "4", "--init-from", str(base),
                 "--resume", "--out", str(tuned)]) == 0


def test_exporting_adapters_never_reads_the_base(
        tuned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_base(*args: object, **kwargs: object) -> None:
        raise AssertionError("the base was loaded")

    monkeypatch.setattr("memfine.artifacts.lora_base.load_base_", no_base)
    target = tmp_path / "adapters.safetensors"
    assert main(["export", "--out", str(tuned), "--to", str(target)]) == 0
    assert target.is_file()
