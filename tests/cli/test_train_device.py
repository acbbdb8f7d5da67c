"""``memfine train`` on CUDA: bf16 autocast over fp32 weights by default, fused AdamW, and
``--deterministic`` (checked on CPU: the resolved config, the optimizer, the torch settings)."""

from __future__ import annotations

import os

import pytest
import torch

from memfine.cli.main import build_parser, main
from memfine.cli.train import resolve_config
from memfine.config import TrainConfig
from memfine.runtime.determinism import deterministic_mode
from memfine.train.optim import build_optimizer


def _config(*flags: str) -> TrainConfig:
    args = build_parser().parse_args(["train", "--preset", "tiny", *flags])
    return resolve_config(args)[0]


@pytest.mark.parametrize(("flags", "autocast", "dtype"), [
    (["--device", "cuda"], "bfloat16", "float32"),
    (["--device", "cuda:1"], "bfloat16", "float32"),
    (["--device", "cuda", "--autocast", "none"], "none", "float32"),
    (["--device", "cuda", "--dtype", "bfloat16"], "none", "bfloat16"),
    (["--device", "cpu"], "none", "float32"),
    ([], "none", "float32"),
], ids=["cuda", "cuda1", "told_none", "bf16_weights", "cpu", "default"])
def test_cuda_defaults_to_bf16_autocast_over_fp32_weights(flags: list[str], autocast: str,
                                                          dtype: str) -> None:
    config = _config(*flags)
    assert (config.autocast, config.dtype) == (autocast, dtype)


def test_adamw_is_fused_on_cuda_only() -> None:
    model = torch.nn.Linear(4, 4)  # fused AdamW also has a CPU kernel, so this builds here
    assert build_optimizer(model, _config("--device", "cuda"))[0].defaults["fused"] is True
    assert not build_optimizer(model, _config())[0].defaults["fused"]


def test_train_on_cuda_without_cuda_is_a_usage_error(tmp_path: object,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "tiny", "--device", "cuda", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--device cuda needs CUDA, and this torch has no CUDA device" in capsys.readouterr().err


def test_deterministic_flag_reaches_the_config() -> None:
    assert _config("--deterministic").deterministic is True
    assert _config().deterministic is False
    with pytest.raises(ValueError, match="TrainConfig.deterministic must be True or False"):
        TrainConfig(deterministic="yes")  # type: ignore[arg-type]


def test_deterministic_mode_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting is kept
    with deterministic_mode():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with deterministic_mode(False):
        assert not torch.are_deterministic_algorithms_enabled()
