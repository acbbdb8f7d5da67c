"""``torchrun ... -m memfine train --dp-shard D --ep E``: the same run as one process.

Every rank builds the model from the same seed and takes its rows of each global batch; experts
are sharded over ``ep`` and FSDP2 shards the rest over the data dims. The per-step training
losses and gradient norms (rank 0's metrics.jsonl) must equal the single-process run on the same
global batches, and the final parameters (the DCP checkpoint, loaded into one process) must
equal the single-process checkpoint. Checkpoints resume across layouts. By default a short
resume chain that starts at one layout (dp1_ep2, checked as a fresh run of it); every layout on
its own, the 4-rank layouts and the full chain are marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ep_harness import free_port

import timeouts
from memfine.artifacts.checkpoint import find_checkpoint, read_checkpoint
from memfine.artifacts.restore import load_states
from memfine.config import TrainConfig
from memfine.nn import MoETransformerLM
from memfine.train.optim import build_optimizer
from tolerances import DISTRIBUTED_LOSS_ATOL, DISTRIBUTED_PARAM_ATOL

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 400  # base, scaled by timeouts.scaled
COMMON = ["train", "--sample-tokens", "0", "--no-progress", "--lr-decay-steps", "20"]
STEPS = 10  # steps of each compared run (the tiny preset's warm-up: the LR changes every step)


def _run(cmd: list[str], cwd: Path, *, expect: int = 0) -> str:
    """Run a command in its own session; kill the whole group on timeout; check its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, _ = timeouts.communicate(proc, RUN_TIMEOUT_S, group=True)
    if proc.returncode != expect:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}, expected {expect}:\n"
                    f"{out[-4000:]}")
    return out


def _train(cwd: Path, out: Path, layout: tuple[int, int], *args: str, expect: int = 0) -> str:
    """``memfine train`` at mesh layout (dp_shard, ep): torchrun when it has > 1 rank."""
    dp_shard, ep = layout
    if dp_shard * ep == 1:
        cmd = [sys.executable, "-m", "memfine"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(dp_shard * ep), "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), "-m", "memfine"]
        args = (*args, "--dp-shard", str(dp_shard), "--ep", str(ep))
    preset = [] if "--resume" in args else ["--preset", "tiny"]
    return _run([*cmd, *COMMON, *preset, *args, "--out", str(out)], cwd, expect=expect)


def _metrics(run_dir: Path, key: str) -> torch.Tensor:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return torch.tensor([json.loads(line)[key] for line in lines], dtype=torch.float64)


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's newest checkpoint (either form) loaded into one process."""
    payload = read_checkpoint(find_checkpoint(run_dir))
    config = TrainConfig.from_dict(payload["config"])
    model = MoETransformerLM(config.model)
    optimizer, _ = build_optimizer(model, config)
    load_states(payload, model, optimizer, sharded=False)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same_run(got: Path, want: Path,
                     keys: tuple[str, ...] = ("train_loss", "grad_norm", "load_balancing_loss",
                                              "z_loss")) -> None:
    for key in keys:
        torch.testing.assert_close(_metrics(got, key), _metrics(want, key),
                                   atol=DISTRIBUTED_LOSS_ATOL, rtol=0, msg=key)
    want_params = _final_params(want)
    for name, value in _final_params(got).items():
        torch.testing.assert_close(value, want_params[name], atol=DISTRIBUTED_PARAM_ATOL, rtol=0,
                                   msg=name)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The STEPS-step one-process reference run."""
    out = tmp_path_factory.mktemp("single") / "run"
    _train(out.parent, out, (1, 1), "--max-steps", str(STEPS))
    return out


def _assert_fresh_multi_rank_run(out: Path, log: str) -> None:
    """The main rank reports the whole model (all experts), not its shard, once; the checkpoint
    is the DCP form only."""
    config = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    full = sum(p.numel() for p in MoETransformerLM(config.model).parameters())
    assert log.count(f"model: {full:,} parameters") == 1, log[-2000:]
    assert log.count("model: ") == 1
    assert (out / "checkpoint.dcp" / "meta.pt").is_file()
    assert not (out / "checkpoint.pt").exists()


# slow-only: dp1_ep2 is also the first segment of test_resume_across_layouts' default chain,
# checked there with _assert_fresh_multi_rank_run
@pytest.mark.parametrize("layout", [
    pytest.param((1, 2), id="dp1_ep2", marks=pytest.mark.slow),
    pytest.param((2, 1), id="dp2_ep1", marks=pytest.mark.slow),
    pytest.param((2, 2), id="dp2_ep2", marks=pytest.mark.slow),
    pytest.param((4, 1), id="dp4_ep1", marks=pytest.mark.slow),
    pytest.param((1, 4), id="dp1_ep4", marks=pytest.mark.slow),
])
def test_layout_matches_single_process(tmp_path: Path, single_run: Path,
                                       layout: tuple[int, int]) -> None:
    out = tmp_path / "run"
    log = _train(tmp_path, out, layout, "--max-steps", str(STEPS))
    _assert_fresh_multi_rank_run(out, log)
    _assert_same_run(out, single_run)


@pytest.mark.parametrize("chain", [
    pytest.param([(1, 2), (2, 1), (1, 1)], id="ep2-dp2-single"),
    pytest.param([(2, 1), (1, 2), (1, 1), (2, 2)], id="dp2-ep2-single-dp2ep2",
                 marks=pytest.mark.slow),
])
def test_resume_across_layouts(tmp_path: Path, single_run: Path,
                               chain: list[tuple[int, int]]) -> None:
    """Each segment resumes the previous one's checkpoint at another layout; the losses of the
    whole chain equal the straight run's. The first segment is a fresh multi-rank run."""
    out = tmp_path / "run"
    stops = [STEPS * (i + 1) // len(chain) for i in range(len(chain))]
    for i, (layout, stop) in enumerate(zip(chain, stops, strict=True)):
        log = _train(tmp_path, out, layout, *(["--resume"] if i else []), "--max-steps",
                     str(stop))
        if i == 0:
            _assert_fresh_multi_rank_run(out, log)
    assert len(_metrics(out, "train_loss")) == STEPS
    _assert_same_run(out, single_run)


# Routing options: shared experts stay whole on every rank, and the aux-loss-free bias moves
# once per step from the counts summed over the ranks, so EP still equals one process.
ROUTING = ("--num-shared-experts", "1", "--bias-update-rate", "1e-2", "--n-group", "2",
           "--topk-group", "1", "--seq-aux-loss-coef", "1e-3")


@pytest.mark.parametrize("layout", [
    pytest.param((1, 2), id="dp1_ep2"),
    pytest.param((2, 2), id="dp2_ep2", marks=pytest.mark.slow),
])
def test_routing_options_match_single_process(tmp_path: Path, layout: tuple[int, int]) -> None:
    single, out = tmp_path / "single", tmp_path / "run"
    _train(tmp_path, single, (1, 1), "--max-steps", str(STEPS), *ROUTING)
    _train(tmp_path, out, layout, "--max-steps", str(STEPS), *ROUTING)
    _assert_same_run(out, single)


@pytest.mark.parametrize("layout", [
    pytest.param((1, 1), id="single"),
    pytest.param((1, 2), id="dp1_ep2", marks=pytest.mark.slow),
])
def test_grad_accum_equals_larger_batch(tmp_path: Path, layout: tuple[int, int]) -> None:
    """``--grad-accum 4 --batch-size 2`` updates as one process's ``--batch-size 8`` with the
    balancing loss on (a large coefficient): losses, balancing loss and z-loss, grad norms and
    parameters. The routing pre-pass gives every micro-batch the step's expert fractions f
    (under expert parallelism summed over the ranks as well)."""
    accum, big = tmp_path / "accum", tmp_path / "big"
    common = ("--max-steps", "8", "--aux-loss-coef", "0.1")
    _train(tmp_path, accum, layout, *common, "--grad-accum", "4", "--batch-size", "2")
    _train(tmp_path, big, (1, 1), *common, "--batch-size", "8")
    _assert_same_run(accum, big)


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"WORLD_SIZE": "2"}, ["--dp-shard", "2", "--ep", "2"],
     "the world size 2 must equal --dp-shard × --ep, got 2 × 2 = 4"),
    ({"WORLD_SIZE": "2"}, ["--ep", "2", "--num-experts", "3", "--top-k", "1"],
     "MoEConfig.num_experts=3 must be divisible by the expert-parallel size ep=2"),
])
def test_bad_layout_is_one_line_and_writes_nothing(tmp_path: Path, env: dict[str, str],
                                                   args: list[str], message: str) -> None:
    out = tmp_path / "run"
    proc = timeouts.run([sys.executable, "-m", "memfine", *COMMON, "--preset", "tiny", *args,
                         "--out", str(out)],
                        RUN_TIMEOUT_S, env={**os.environ, **env}, capture_output=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"memfine train: error: {message}"), lines
    assert not out.exists()


def test_checkpoint_of_another_model_shape_is_one_line(tmp_path: Path, single_run: Path) -> None:
    """Resuming with another model width: one error line; the run's files stay as they were."""
    before = {p.name: p.read_bytes() for p in single_run.iterdir() if p.is_file()}
    proc = timeouts.run([sys.executable, "-m", "memfine", *COMMON, "--resume", "--max-steps",
                         "30", "--hidden-size", "32", "--out", str(single_run)],
                        RUN_TIMEOUT_S, capture_output=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--hidden-size cannot change on --resume" in lines[0], lines
    assert {p.name: p.read_bytes() for p in single_run.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_compile_with_expert_parallelism(tmp_path: Path, single_run: Path) -> None:
    """``--compile`` at (dp_shard, ep) = (1, 2): each block's collective-free regions run
    compiled, the experts' all-to-alls and FSDP2's hooks eagerly; the run equals one process."""
    out = tmp_path / "run"
    _train(tmp_path, out, (1, 2), "--max-steps", str(STEPS), "--compile")
    _assert_same_run(out, single_run)
