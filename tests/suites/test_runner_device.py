"""The benchmark scripts' ``--device``: cpu by default, cuda when asked, a usage error without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfine.bench.options import BenchOptions
from memfine.suites import runner


def _devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str
             ) -> tuple[BenchOptions, torch.device]:
    seen: list[tuple[BenchOptions, torch.device]] = []
    monkeypatch.setattr(runner, "run_suites", lambda opts, device: seen.append((opts, device))
                        or [])
    assert runner.script_main("experts", tmp_path, list(argv)) == 0
    return seen[0]


def test_cpu_by_default_and_auto_without_cuda(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    opts, device = _devices(monkeypatch, tmp_path)
    assert (opts.device, device) == ("cpu", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _devices(monkeypatch, tmp_path, "--device", "auto")[1] == torch.device("cpu")


def test_cuda_when_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    opts, device = _devices(monkeypatch, tmp_path, "--device", "cuda:1")
    assert (opts.device, device) == ("cuda", torch.device("cuda", 1))
    assert _devices(monkeypatch, tmp_path, "--device", "auto")[1] == torch.device("cuda")


@pytest.mark.parametrize(("choice", "message"), [
    ("cuda", "--device cuda: CUDA is not available"),
    ("tpu", "--device must be cpu, cuda[:i] or auto, got 'tpu'"),
    ("meta", "--device must be cpu, cuda[:i] or auto, got 'meta'"),
])
def test_bad_device_is_a_usage_error(choice: str, message: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        runner.script_main("experts", tmp_path, ["--device", choice])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
