"""``memfine train``: golden losses, resume, flags, bad input (memfine.cli.train); Ctrl-C and
SIGTERM: test_train_signals.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from memfine.cli import train as train_cli
from memfine.cli.main import build_parser, main
from memfine.reports.metrics import read_metrics
from memfine.train import load_checkpoint
from tolerances import LOSS_ATOL, assert_close

ASSETS = Path(__file__).parents[1] / "assets"
CORPUS = str(ASSETS / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1"]

# Pinned: a change to the flag set of `memfine train` must be deliberate (update this list).
TRAIN_FLAGS = sorted([
    "--activation", "--allow-over-budget", "--autocast", "--aux-loss-coef", "--backend",
    "--backward-block-bytes", "--batch-size", "--bias-update-rate", "--bins", "--budget-scope",
    "--capacity-factor", "--chunk-bins", "--compile", "--config", "--data", "--device",
    "--deterministic", "--dp-shard", "--drop-policy", "--dtype", "--ep", "--eval-batches",
    "--eval-every",
    "--experts-impl", "--gemm-backend", "--grad-accum", "--grad-clip", "--help",
    "--hidden-size",
    "--index-builder", "--init-from", "--intermediate-size", "--log-every", "--lr",
    "--lora-alpha", "--lora-base-quant", "--lora-dropout", "--lora-rank", "--lora-targets",
    "--lora-train-attention",
    "--lora-train-router", "--lr-decay-steps", "--max-steps", "--memory-budget",
    "--min-capacity", "--min-lr-ratio",
    "--moe-chunks", "--moe-memory-budget", "--n-group", "--no-progress", "--no-renormalize",
    "--no-shared-expert-gate", "--num-chunks", "--num-experts", "--num-heads", "--num-layers",
    "--num-shared-experts", "--out", "--overwrite", "--plot", "--preset", "--recompute",
    "--renormalize", "--resume", "--routed-scaling-factor", "--router-jitter-eps",
    "--sample-tokens", "--save-every", "--score-func", "--seed", "--seq-aux-loss-coef",
    "--seq-len", "--shared-expert-gate", "--shared-intermediate-size", "--skew-bias",
    "--skew-hot-experts", "--tensorboard", "--threads", "--top-k", "--topk-group", "--tracker",
    "--val-fraction", "--warmup-steps", "--weight-decay", "--z-loss-coef", "-h",
])


def _train(*args: str) -> int:
    return main(["train", *FAST, *args])


def _losses(out: Path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(out / "metrics.jsonl")]


def _golden() -> list[tuple[int, float]]:
    lines = (ASSETS / "golden_loss_cpu.txt").read_text().splitlines()
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return [(int(step), float(loss)) for step, loss in rows]


@pytest.mark.parametrize("chunking", [
    pytest.param([], id="unchunked"),
    pytest.param(["--num-chunks", "2"], id="chunks2"),
    # an inductor compile of the model's forward and backward: minutes on a busy 2-core CPU
    pytest.param(["--compile"], id="compiled", marks=pytest.mark.slow),
])
def test_smoke_losses_match_golden(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   chunking: list[str]) -> None:
    assert _train("--max-steps", "8", "--out", str(tmp_path), *chunking) == 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    golden = _golden()
    assert [r["step"] for r in records] == [step for step, _ in golden]
    for record, (step, loss) in zip(records, golden, strict=True):
        assert abs(record["train_loss"] - loss) <= LOSS_ATOL, f"step {step}"
    expected_chunks = 2 if "--num-chunks" in chunking else 1
    assert all(r["num_chunks"] == [expected_chunks] * 2 for r in records)
    out = capsys.readouterr().out
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_steps"] == 8 and config["model"]["chunk"]["num_chunks"] == expected_chunks
    assert "final validation loss:" in out and "bits/byte" in out
    assert "unigram (byte-frequency) entropy of the validation split" in out


def test_resume_equals_straight_run(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train("--max-steps", "14", "--out", str(straight)) == 0
    assert _train("--max-steps", "7", "--lr-decay-steps", "14", "--out", str(split)) == 0
    assert main(["train", "--resume", "--max-steps", "14", "--out", str(split),
                 "--no-progress", "--threads", "1"]) == 0
    got, want = _losses(split), _losses(straight)
    assert len(got) == len(want) == 14
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOSS_ATOL
    final = [read_metrics(d / "metrics.jsonl")[-1]["val_loss"] for d in (split, straight)]
    assert abs(final[0] - final[1]) <= LOSS_ATOL


def test_flag_set_is_pinned() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train_parser = subparsers.choices["train"]
    flags = sorted(s for a in train_parser._actions for s in a.option_strings)
    assert flags == TRAIN_FLAGS


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--preset {small,tiny}" in text and "(default: small)" in text
    assert "model width d (default: tiny: 64, small: 128)" in text
    assert "(default: pydoc)" in text


def _write(tmp_path: Path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def _fifo(path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(path)
    return path


BAD_INPUTS = [
    pytest.param(lambda p: ["--hidden-size", "-4"],
                 "error: --hidden-size must be >= 1, got -4\n", id="negative_hidden_size"),
    pytest.param(lambda p: ["--batch-size", "-1"],
                 "error: --batch-size must be >= 1, got -1\n", id="negative_batch_size"),
    pytest.param(lambda p: ["--num-experts", "4", "--top-k", "5"],
                 "error: --top-k must be in [1, --num-experts=4], got 5\n", id="top_k_gt_experts"),
    # a check across fields, tripped by a flag on the other field: both named as flags
    pytest.param(lambda p: ["--num-experts", "1"], "error: --top-k must be in [1, "
                 "--num-experts=1], got 2 (given: --num-experts 1)\n", id="num_experts_below_k"),
    pytest.param(lambda p: ["--hidden-size", "65"], "error: --num-heads must be a divisor of "
                 "--hidden-size=65, got 2 (given: --hidden-size 65)\n", id="heads_not_dividing"),
    pytest.param(lambda p: ["--num-chunks", "100000"], "error: --num-chunks must be at most the "
                 "tokens of one MoE layer's call, 512 (--batch-size 8 × --seq-len 64), got "
                 "100000", id="more_chunks_than_tokens"),
    pytest.param(lambda p: ["--hidden-size", "1000000"], "free on cpu; lower --hidden-size",
                 id="model_larger_than_memory"),
    pytest.param(lambda p: ["--out", ""], "argument --out: expected a path, got ''",
                 id="empty_out"),
    pytest.param(lambda p: ["--data", str(_fifo(p / "pipe"))], "pipe' is not a regular file",
                 id="fifo_data"),
    pytest.param(lambda p: ["--config", _write(p, "run.toml", b"lr = 'fast'\n"), "--lr", "0.1"],
                 "run.toml': lr: expected a number, got 'fast'",
                 id="bad_toml_value_also_given"),
    pytest.param(lambda p: ["--activation", "swish"], "invalid choice: 'swish'",
                 id="unknown_activation"),
    pytest.param(lambda p: ["--memory-budget", "16"],
                 "argument --memory-budget: byte size needs a unit", id="budget-without-unit"),
    pytest.param(lambda p: ["--memory-budget", "12XB"], "byte size must look like",
                 id="bad_memory_budget"),
    pytest.param(lambda p: ["--data", _write(p, "empty.txt", b"")], "empty.txt' is empty",
                 id="empty_data_file"),
    pytest.param(lambda p: ["--data", str(p / "missing.txt")], "missing.txt' does not exist",
                 id="missing_data_file"),
    pytest.param(lambda p: ["--data", _write(p, "junk.bin", bytes(range(256)) * 4)],
                 "junk.bin' does not look like text", id="binary_data_file"),
    pytest.param(lambda p: ["--data", _write(p, "short.txt", b"too short")],
                 "are too few for --seq-len 64", id="data_too_small"),
    pytest.param(lambda p: ["--resume"], "checkpoint.dcp' (train without --resume first)",
                 id="resume_without_checkpoint"),
    # a config field set by a flag: the flag, what it allows as typed, the value typed
    pytest.param(lambda p: ["--seed", "4294967296"], "error: --seed must be in [0, 4294967295], "
                 "got 4294967296\n", id="seed_too_large"),
    pytest.param(lambda p: ["--save-every", "0"], "error: --save-every must be >= 1, got 0\n",
                 id="save_every_zero"),
    pytest.param(lambda p: ["--threads", "0"], "--threads must be >= 1, got 0", id="threads_0"),
    pytest.param(lambda p: ["--max-steps", "0"], "error: --max-steps must be in [1, 4294967295], "
                 "got 0\n", id="max_steps_0"),
    pytest.param(lambda p: ["--lr", "-1e-3"], "error: --lr must be > 0, got -0.001\n",
                 id="lr_negative"),
    pytest.param(lambda p: ["--lr", "inf"],
                 "error: argument --lr: expected a finite number, got 'inf'",
                 id="lr_inf"),
    pytest.param(lambda p: ["--weight-decay", "-0.5"], "error: --weight-decay must be >= 0, "
                 "got -0.5\n", id="weight_decay_negative"),
    pytest.param(lambda p: ["--memory-budget", "1KiB"], "--memory-budget 1024 bytes (0.00 MiB) "
                 "cannot be met by any chunk count in --bins 1,2,4,8: one MoE layer call",
                 id="budget_below_the_fixed_bytes"),
    pytest.param(lambda p: ["--memory-budget", "600KiB"], "--memory-budget 614400 bytes "
                 "(0.59 MiB) cannot be met by any chunk count in --bins 1,2,4,8:",
                 id="budget_needs_a_larger_bin"),
    pytest.param(lambda p: ["--data", str(p), "--overwrite"], "lies in the data directory",
                 id="out_is_the_data_directory"),
]


@pytest.mark.parametrize(("make_args", "message"), BAD_INPUTS)
def test_bad_input_exits_2_with_a_clear_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make_args, message: str) -> None:
    args = make_args(tmp_path)
    base = ["--no-progress"] if "--resume" in args else [*FAST]
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as info:
        main(["train", *base, "--out", str(tmp_path), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before  # nothing left behind: no config.json, no lock


def test_a_failed_run_can_run_again_into_the_same_out(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "runs" / "a"
    # without the up-front check the budget is found by MACT in the first step, after set-up
    monkeypatch.setattr(train_cli, "check_memory_budget", lambda config, world: None)
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--max-steps", "2", "--memory-budget", "1KiB", "--out", str(out)])
    assert info.value.code == 2
    assert ("error: --memory-budget 1024 bytes (0.00 MiB) cannot be met by any chunk count in "
            "--bins") in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert _train("--max-steps", "2", "--memory-budget", "1MiB", "--out", str(out)) == 0
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_checkpoint_exits_2_naming_the_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    assert _train("--max-steps", "2", "--out", str(tmp_path)) == 0
    path = tmp_path / "checkpoint.pt"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3] if damage == "truncated" else b"\x00junk" * 50)
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--out", str(tmp_path), "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"checkpoint '{path}' is corrupt or truncated" in err and "Traceback" not in err


def test_resume_rejects_model_flag_change(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _train("--max-steps", "2", "--out", str(tmp_path)) == 0
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--hidden-size", "32", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "--hidden-size cannot change on --resume" in capsys.readouterr().err


def test_plot_writes_chunks_and_loss_png(tmp_path: Path) -> None:
    assert _train("--max-steps", "3", "--out", str(tmp_path), "--plot") == 0
    for name in ("chunks.png", "loss.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_existing_run_is_not_overwritten_without_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train("--max-steps", "2", "--out", str(tmp_path)) == 0
    checkpoint = (tmp_path / "checkpoint.pt").read_bytes()
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as exc:
        _train("--max-steps", "1", "--out", str(tmp_path))
    assert exc.value.code == 2
    assert "already holds config.json, metrics.jsonl, checkpoint.pt" in capsys.readouterr().err
    assert (tmp_path / "checkpoint.pt").read_bytes() == checkpoint  # nothing lost
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    assert _train("--max-steps", "1", "--out", str(tmp_path), "--overwrite") == 0
    assert len(_losses(tmp_path)) == 1


def test_unwritable_out_is_a_one_line_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit) as exc:
        _train("--max-steps", "1", "--out", str(blocker / "run"))
    err = capsys.readouterr().err
    assert exc.value.code == 2  # a usage error, found before anything is loaded or written
    assert err.startswith("memfine train: error: --out") and err.count("\n") == 1
    assert "which is not a directory" in err and "Traceback" not in err


def test_resume_with_nothing_left_to_train_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train("--max-steps", "3", "--out", str(tmp_path)) == 0
    capsys.readouterr()
    for steps in ("2", "3"):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--resume", "--max-steps", steps, "--out", str(tmp_path),
                  "--no-progress"])
        assert exc.value.code == 2
        out, err = capsys.readouterr()
        assert "already at step 3" in err and out == ""  # said before the data line


def test_bf16_weights_keep_an_fp32_selection_bias(tmp_path: Path) -> None:
    """--dtype bfloat16 stores bf16 weights; the router's selection bias stays fp32."""
    assert _train("--max-steps", "1", "--dtype", "bfloat16", "--sample-tokens", "0",
                  "--skew-hot-experts", "1", "--skew-bias", "0.3", "--out", str(tmp_path)) == 0
    state = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    biases = {k: v for k, v in state.items() if k.endswith("selection_bias")}
    assert biases and all(v.dtype == torch.float32 for v in biases.values())
    assert all(float(v[0]) == pytest.approx(0.3) for v in biases.values())  # not bf16-rounded
    assert state["embed.weight"].dtype == torch.bfloat16


def test_autocast_bf16_trains_with_fp32_master_weights(tmp_path: Path) -> None:
    assert _train("--max-steps", "2", "--autocast", "bf16", "--sample-tokens", "0",
                  "--out", str(tmp_path)) == 0
    payload = load_checkpoint(tmp_path / "checkpoint.pt")
    assert payload["config"]["autocast"] == "bfloat16"
    assert all(v.dtype == torch.float32 for v in payload["model"].values()
               if v.is_floating_point())
    golden = dict(_golden())
    losses = _losses(tmp_path)
    # bf16 compute: the first loss (same initial weights) within bf16's forward tolerance
    assert_close(torch.tensor(losses[0]), torch.tensor(golden[1]), dtype=torch.bfloat16)
    assert losses[0] != golden[1]  # it did run in bf16
    assert all(math.isfinite(x) for x in losses)


def test_validation_does_not_depend_on_the_batch_layout(tmp_path: Path) -> None:
    """Four micro-batches of 2 train as one batch of 8, so both validate alike."""
    runs = {"accum": ["--batch-size", "2", "--grad-accum", "4"], "batch": ["--batch-size", "8"]}
    val = {}
    for name, layout in runs.items():
        assert _train("--max-steps", "2", "--eval-every", "2", "--out", str(tmp_path / name),
                      *layout) == 0
        val[name] = [r["val_loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
                     if "val_loss" in r]
    assert len(val["accum"]) == len(val["batch"]) == 1
    assert abs(val["accum"][0] - val["batch"][0]) <= LOSS_ATOL


def test_resume_accepts_the_original_command(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    first = ["--preset", "tiny", "--num-experts", "8", "--out", str(tmp_path)]
    assert _train("--max-steps", "1", "--lr-decay-steps", "20", *first) == 0
    assert _train("--max-steps", "2", "--lr-decay-steps", "20", *first, "--resume") == 0
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2
    with pytest.raises(SystemExit) as info:  # another preset starts another run: refused
        _train("--max-steps", "3", "--out", str(tmp_path), "--resume", "--preset", "small")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--preset starts another run than the checkpoint in" in err
    assert "--hidden-size 64 -> 128" in err and "Traceback" not in err


def test_resume_after_a_lost_checkpoint_mentions_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train("--max-steps", "1", "--out", str(tmp_path)) == 0
    (tmp_path / "checkpoint.pt").unlink()
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--out", str(tmp_path), "--no-progress"])
    assert info.value.code == 2
    assert ("(train without --resume first; --out still holds config.json, metrics.jsonl, "
            "summary.json, sample.txt, so add --overwrite to replace them)") in (
        capsys.readouterr().err)


def test_read_only_out_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only mount (EROFS): simulated, since root may write anywhere on this disk."""
    import errno
    import tempfile

    from memfine.artifacts import rundir

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir.tempfile, "TemporaryFile", read_only)
    with pytest.raises(SystemExit) as info:
        _train("--max-steps", "1", "--out", str(tmp_path / "run"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"memfine train: error: --out '{tmp_path / 'run'}' is not writable (its "
                   f"parent '{tmp_path}' exists): Read-only file system; choose a directory "
                   "you can write\n")
    monkeypatch.undo()
    if os.geteuid() != 0:  # without root, a directory without write permission is one too
        tmp_path.chmod(0o555)
        try:
            with pytest.raises(SystemExit):
                _train("--max-steps", "1", "--out", str(tmp_path / "run"))
        finally:
            tmp_path.chmod(0o755)
    assert tempfile.TemporaryFile is not read_only and not (tmp_path / "run").exists()


def test_plot_without_matplotlib_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    with pytest.raises(SystemExit) as info:
        _train("--max-steps", "1", "--out", str(tmp_path), "--plot")
    assert info.value.code == 2
    assert capsys.readouterr().err == ("memfine train: error: matplotlib is required for this "
                                       "feature: pip install 'memfine[train]'\n")
    assert list(tmp_path.iterdir()) == []


def test_start_and_resume_remove_temporaries_of_killed_saves(tmp_path: Path) -> None:
    assert _train("--max-steps", "1", "--out", str(tmp_path)) == 0
    stale = tmp_path / ".checkpoint.pt.k1ll3d.tmp"
    stale.write_bytes(b"\0" * 1000)  # what a save killed mid-write leaves
    assert _train("--max-steps", "2", "--out", str(tmp_path), "--resume") == 0
    assert not stale.exists()
    stale.write_bytes(b"\0" * 1000)
    assert _train("--max-steps", "1", "--out", str(tmp_path), "--overwrite") == 0
    assert not stale.exists()


def test_ranks_other_than_the_main_one_print_no_setup_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memfine.reports.outputs import Outputs
    from memfine.train import preset
    from memfine.train.parallel import SingleProcess
    from memfine.train.setup import setup_run

    class OtherRank(SingleProcess):
        is_main = False

    config = dataclasses.replace(preset("tiny"), data=CORPUS)
    for parallel, printed in ((OtherRank(), False), (SingleProcess(), True)):
        capsys.readouterr()
        setup_run(config, tmp_path, resume=False, outputs=Outputs(progress=False),
                  parallel=parallel)
        out = capsys.readouterr().out
        assert all((word in out) is printed for word in ("data: ", "config: ", "model: "))


def test_no_progress_bar_into_a_piped_log(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """stderr is no terminal here (captured): the bar's redraws stay out of the log."""
    pytest.importorskip("tqdm")
    argv = [a for a in FAST if a != "--no-progress"]
    assert main(["train", *argv, "--max-steps", "2", "--sample-tokens", "0",
                 "--out", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "step/s" not in err and "done: " in out
    from memfine.reports.outputs import Outputs
    from memfine.train import preset

    (tmp_path / "forced").mkdir()
    log, bar = Outputs(progress=True).open(tmp_path / "forced", preset("tiny"), start=0,
                                           resume=False, is_main=True)
    assert not bar.disable  # progress=True still forces it
    bar.close()
    assert log is not None
    log.close()
