"""What the checkpoint commands refuse in one line: non-finite weights, a read-only ``--to``
folder, a missing optional package (memfine.cli.generate, evaluate, export)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
import torch

from memfine.cli.main import main

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *FAST, "--max-steps", "1", "--sample-tokens", "0",
                 "--out", str(out)]) == 0
    return out


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", [["generate", "--prompt", "def "], ["eval"], ["export"]])
def test_a_checkpoint_with_non_finite_weights_is_refused(
        run_dir: Path, tmp_path: Path, command: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    nan_run = tmp_path / "nan"
    shutil.copytree(run_dir, nan_run)
    payload = torch.load(nan_run / "checkpoint.pt", weights_only=True)
    payload["model"]["blocks.0.moe.experts.w_down"][0, 0, 0] = float("nan")
    torch.save(payload, nan_run / "checkpoint.pt")
    err = _one_line_error(capsys, [command[0], "--out", str(nan_run), *command[1:]])
    assert f"checkpoint '{nan_run / 'checkpoint.pt'}' holds non-finite weights (1 of " in err
    assert "blocks.0.moe.experts.w_down" in err
    assert not (nan_run / "model.safetensors").exists()


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
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert any(dep.startswith("safetensors")
               for dep in pyproject["project"]["optional-dependencies"]["train"])
