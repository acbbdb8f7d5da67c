"""Training on CUDA: the CLI defaults, --deterministic, resume with the CUDA RNG, one nccl rank.

The runs use the ``tiny`` preset on the committed corpus sample, a few steps each.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from ep_harness import free_port

from devices import gpu
from memfine.cli.main import main
from memfine.reports.metrics import read_metrics
from memfine.train import preset, train
from tolerances import DISTRIBUTED_LOSS_ATOL

pytestmark = gpu
CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--sample-tokens", "0",
        "--eval-every", "4", "--device", "cuda"]


def _losses(out: Path) -> list[float]:
    return [row["train_loss"] for row in read_metrics(out / "metrics.jsonl")]


def test_cuda_train_defaults_and_deterministic_repeats(tmp_path: Path) -> None:
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        assert main(["train", *FAST, "--max-steps", "8", "--log-every", "1",
                     "--deterministic", "--router-jitter-eps", "0.01", "--out", str(out)]) == 0
    config = (runs[0] / "config.json").read_text()
    assert '"autocast": "bfloat16"' in config and '"dtype": "float32"' in config
    losses = _losses(runs[0])
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses == _losses(runs[1])  # bitwise: deterministic algorithms, same seed
    assert losses[-1] < losses[0]


def test_resume_on_cuda_repeats_the_straight_run(tmp_path: Path) -> None:
    """Router jitter draws on the CUDA generator: resume is exact only with its state saved."""
    common = [*FAST, "--deterministic", "--router-jitter-eps", "0.05", "--log-every", "1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *common, "--max-steps", "8", "--out", str(straight)]) == 0
    assert main(["train", *common, "--max-steps", "4", "--lr-decay-steps", "8",
                 "--out", str(resumed)]) == 0
    assert main(["train", "--resume", "--max-steps", "8", "--no-progress", "--sample-tokens",
                 "0", "--deterministic", "--out", str(resumed)]) == 0
    assert _losses(resumed)[-4:] == _losses(straight)[-4:]


def test_distributed_engine_on_one_nccl_rank(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from memfine.parallel.training import DistributedTraining

    config = dataclasses.replace(preset("tiny"), data=CORPUS, device="cuda", max_steps=6,
                                 eval_every=6, sample_tokens=0, log_every=1)
    single = train(config, tmp_path / "single", progress=False)
    for key, val in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, val)
    engine = DistributedTraining.from_environment(dp_shard=1, ep=1, backend="nccl",
                                                  device="cuda")
    finished = False
    try:
        result = train(config, tmp_path / "nccl", progress=False, parallel=engine)
        finished = True
    finally:
        engine.close(barrier=finished)
    assert torch.cuda.current_device() == 0
    torch.testing.assert_close(torch.tensor(result.train_losses),
                               torch.tensor(single.train_losses), atol=DISTRIBUTED_LOSS_ATOL,
                               rtol=0)
    assert os.environ["WORLD_SIZE"] == "1"
