"""``memfine train --lora-base-quant nf4`` (QLoRA): resume, export and bad input (memfine.cli)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_lora_cli import FAST, LORA

from memfine.cli.main import main
from memfine.reports.metrics import read_metrics
from tolerances import LOSS_ATOL

pytest.importorskip("bitsandbytes", reason="the 4-bit base needs bitsandbytes (memfine[qlora])")

QUANT = [*LORA, "--lora-base-quant", "nf4"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base")
    assert main(["train", *FAST, "--max-steps", "2", "--out", str(out)]) == 0
    return out


def _losses(run: Path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(run / "metrics.jsonl")]


def test_resume_requantises_the_base_and_equals_the_straight_run(base: Path,
                                                                  tmp_path: Path) -> None:
    straight, split, full = tmp_path / "straight", tmp_path / "split", tmp_path / "full"
    common = [*FAST, *QUANT, "--init-from", str(base)]
    assert main(["train", *common, "--max-steps", "3", "--out", str(straight)]) == 0
    assert main(["train", *common, "--max-steps", "1", "--lr-decay-steps", "3",
                 "--out", str(split)]) == 0
    assert main(["train", "--resume", "--max-steps", "3", "--out", str(split),
                 "--no-progress", "--threads", "1"]) == 0
    got, want = _losses(split), _losses(straight)
    assert len(got) == len(want) == 3
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOSS_ATOL
    # the 4-bit base is in use: step 1's loss differs from the full-precision base's
    assert main(["train", *FAST, *LORA, "--init-from", str(base), "--max-steps", "1",
                 "--out", str(full)]) == 0
    assert abs(_losses(full)[0] - want[0]) > LOSS_ATOL


def test_export_merged_is_refused_and_adapters_export(base: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    run = tmp_path / "run"
    assert main(["train", *FAST, *QUANT, "--init-from", str(base), "--max-steps", "1",
                 "--out", str(run)]) == 0
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["export", "--out", str(run), "--merged"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfine export: error: --merged cannot fold adapters trained on a "
                          "4-bit base (--lora-base-quant nf4)") and "\n" not in err
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written
    assert main(["export", "--out", str(run)]) == 0
    assert (run / "adapters.safetensors").exists()


def test_unquantisable_shape_is_one_line_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    odd = tmp_path / "odd"
    assert main(["train", *FAST, "--hidden-size", "12", "--intermediate-size", "20",
                 "--max-steps", "1", "--out", str(odd)]) == 0
    out = tmp_path / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, *QUANT, "--init-from", str(odd), "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfine train: error: ") and "\n" not in err
    assert "LoRAConfig.base_quant='nf4' needs w_up's d·G = 480 (per expert) divisible by " \
           "the block size 64" in err
    assert not out.exists()


def test_base_quant_needs_lora_rank(base: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--lora-base-quant", "nf4", "--init-from", str(base),
              "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    assert "--lora-base-quant needs --lora-rank" in capsys.readouterr().err




def test_missing_bitsandbytes_is_one_line_exit_2(base: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import memfine.flags.train_config as train_config

    monkeypatch.setattr(train_config, "is_available", lambda name: name != "bitsandbytes")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, *QUANT, "--init-from", str(base), "--out", str(out)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == ("memfine train: error: --lora-base-quant nf4 "
                                               "needs bitsandbytes: pip install "
                                               "'memfine[qlora]'")
    assert not out.exists()


def test_a_4_bit_base_added_on_resume_is_one_line(base: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A plain LoRA run's config records no ``base_quant``: adding it on --resume is refused."""
    run = tmp_path / "run"
    assert main(["train", *FAST, *LORA, "--init-from", str(base), "--max-steps", "1",
                 "--out", str(run)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--out", str(run), "--lora-base-quant", "nf4",
              "--max-steps", "2", "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfine train: error: --lora-base-quant cannot change on --resume")
    assert "\n" not in err
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before


def test_init_from_a_4bit_run_is_one_line_before_the_data(base: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    run = tmp_path / "run"
    assert main(["train", *FAST, *QUANT, "--init-from", str(base), "--max-steps", "1",
                 "--out", str(run)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, *QUANT, "--init-from", str(run), "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the data line
    assert err.strip() == (
        f"memfine train: error: --init-from {str(run)!r} was trained with --lora-base-quant nf4: "
        f"its adapters sit on a 4-bit base with no full-precision weights to start from; "
        f"--init-from takes a run trained without --lora-base-quant (e.g. its base run "
        f"{str(base)!r})")
