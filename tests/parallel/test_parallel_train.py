"""``torchrun --nproc_per_node 2 -m memfine train --ep 2``: same losses as one process.

Every rank builds the model from the same seed and takes its half of each global batch; experts
are sharded over the two ranks. The per-step training losses (rank 0's metrics.jsonl, averaged
over the ranks) must equal the single-process run on the same global batches, and the EP run's
checkpoint (full, gathered expert tensors) must load into the single-process model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ep_harness import free_port

from memfine.config import TrainConfig
from memfine.nn import MoETransformerLM
from memfine.train import ByteCorpus, load_checkpoint
from memfine.train.data import val_batches
from memfine.train.evaluation import evaluate
from tolerances import LOSS_ATOL

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 300
# The load-balancing loss stays on (default coefficient): under EP each rank uses the global
# batch's expert fractions f (counts all-reduced over the ranks) with its local P, so the mean
# over ranks equals the single-process value.
COMMON = ["train", "--preset", "tiny", "--max-steps", "20", "--sample-tokens", "0",
          "--no-progress"]


def _run(cmd: list[str], cwd: Path) -> str:
    """Run a command in its own session; kill the whole group on timeout; fail with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} exceeded {RUN_TIMEOUT_S} s:\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-4000:]}")
    return out


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["train_loss"] for line in lines]


# Routing options: shared experts stay whole on every rank, and the aux-loss-free bias moves
# once per step from the counts summed over both ranks, so EP still equals one process.
ROUTING = ["--num-shared-experts", "1", "--bias-update-rate", "1e-2", "--n-group", "2",
           "--topk-group", "1"]


@pytest.mark.parametrize("extra", [pytest.param([], id="default"),
                                   pytest.param(ROUTING, id="routing_options")])
def test_torchrun_ep2_matches_single_process(tmp_path: Path, extra: list[str]) -> None:
    ep_dir, single_dir = tmp_path / "ep2", tmp_path / "single"
    ep_out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                   "-m", "memfine", *COMMON, *extra, "--ep", "2", "--out", str(ep_dir)],
                  tmp_path)
    single_out = _run([sys.executable, "-m", "memfine", *COMMON, *extra, "--out",
                       str(single_dir)], tmp_path)
    # every rank reports the whole model (all experts), not its own shard
    cfg = TrainConfig.from_dict(json.loads((single_dir / "config.json").read_text()))
    full = sum(p.numel() for p in MoETransformerLM(cfg.model).parameters())
    assert f"model: {full:,} parameters" in single_out
    assert ep_out.count(f"model: {full:,} parameters") == 2, ep_out[-2000:]

    ep_losses, single_losses = _losses(ep_dir), _losses(single_dir)
    assert len(ep_losses) == len(single_losses) == 20
    torch.testing.assert_close(torch.tensor(ep_losses), torch.tensor(single_losses),
                               atol=LOSS_ATOL, rtol=0)
    assert sorted(p.name for p in ep_dir.iterdir()) == sorted(p.name
                                                            for p in single_dir.iterdir())

    # The EP checkpoint holds full expert tensors (parameters and AdamW state): it loads into the
    # one-process model, which then gives the single-process run's final validation loss.
    ep_ckpt = load_checkpoint(ep_dir / "checkpoint.pt")
    single_ckpt = load_checkpoint(single_dir / "checkpoint.pt")
    assert _shapes(ep_ckpt["model"]) == _shapes(single_ckpt["model"])
    assert {i: _shapes(s) for i, s in ep_ckpt["optimizer"]["state"].items()} == \
        {i: _shapes(s) for i, s in single_ckpt["optimizer"]["state"].items()}
    config = TrainConfig.from_dict(ep_ckpt["config"])
    model = MoETransformerLM(config.model)
    model.load_state_dict(ep_ckpt["model"])
    corpus = ByteCorpus.load(config.data, val_fraction=config.val_fraction,
                             seq_len=config.seq_len)
    batches = val_batches(corpus.val_ids, num_batches=config.eval_batches,
                          batch_size=config.batch_size, seq_len=config.seq_len)
    single_val = json.loads((single_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert abs(evaluate(model, batches, torch.device("cpu")) - single_val["val_loss"]) \
        <= LOSS_ATOL


def _shapes(state: dict[str, object]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_single_process_checkpoint_resumes_at_ep2(tmp_path: Path) -> None:
    """A one-process checkpoint (step 10) continues under --ep 2 exactly as one process would."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    schedule = ["--lr-decay-steps", "20"]
    _run([sys.executable, "-m", "memfine", *COMMON, *schedule, "--out", str(straight)], tmp_path)
    first_half = [a if a != "20" else "10" for a in COMMON]  # --max-steps 10
    _run([sys.executable, "-m", "memfine", *first_half, *schedule, "--out", str(resumed)],
         tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
          "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "memfine",
          "train", "--resume", "--max-steps", "20", "--no-progress", "--ep", "2",
          "--out", str(resumed)], tmp_path)
    torch.testing.assert_close(torch.tensor(_losses(resumed)), torch.tensor(_losses(straight)),
                               atol=LOSS_ATOL, rtol=0)
