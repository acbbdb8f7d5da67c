"""``torchrun ... -m memfine train --lora-rank r --init-from RUN``: LoRA on ranks = one process.

The frozen base is sharded like any weight (experts over ``ep``, FSDP2 over the data dims), the
adapters with it; each rank trains on its rows of every global batch. Per-step losses and
gradient norms must equal the one-process LoRA run, the checkpoint is a DCP directory holding
only what training changes (adapters, buffers, AdamW state) plus the base's reference, and it
resumes at another layout — two ranks → one process — into the straight run's losses and
adapters. One chain runs by default; the other layouts are marked slow. The same holds for a
4-bit (NF4) base, ``--lora-base-quant nf4``, each rank keeping its experts' NF4 codes (slow
torchrun runs; by default an in-process one-rank sharding check).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_training import COMMON, RUN_TIMEOUT_S, _metrics, _train

import timeouts
from memfine.cli.main import main
from memfine.config.lora import LoRAConfig
from memfine.inference.adapters import load_adapters
from memfine.inference.trained import load_trained
from memfine.nn import MoETransformerLM
from memfine.nn.lora import apply_lora
from memfine.parallel import shard_model
from memfine.parallel.lora_experts import ExpertParallelLoRAExperts
from memfine.parallel.mesh import build_context
from memfine.train.presets import preset
from tolerances import (
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_PARAM_ATOL,
    SHARDED_GRAD_ATOL,
    SHARDED_GRAD_RTOL,
    SHARDED_LOSS_RTOL,
)

pytestmark = pytest.mark.distributed

LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--warmup-steps", "1")
QLORA = (*LORA, "--lora-base-quant", "nf4")
STEPS = 6
QLORA_STEPS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step one-process base run (the frozen weights)."""
    out = tmp_path_factory.mktemp("base") / "run"
    _train(out.parent, out, (1, 1), "--max-steps", "3")
    return out


@pytest.fixture(scope="module")
def straight(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process LoRA run of STEPS steps on ``base``."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _train(out.parent, out, (1, 1), *LORA, "--init-from", str(base), "--max-steps", str(STEPS))
    return out


def _assert_same_lora_run(got: Path, want: Path) -> None:
    for key in ("train_loss", "grad_norm", "load_balancing_loss", "z_loss"):
        torch.testing.assert_close(_metrics(got, key), _metrics(want, key),
                                   atol=DISTRIBUTED_LOSS_ATOL, rtol=0, msg=key)
    want_params = load_trained(want).model.state_dict()  # the base read from the base run
    got_params = load_trained(got).model.state_dict()
    assert got_params.keys() == want_params.keys()
    for name, value in got_params.items():
        torch.testing.assert_close(value, want_params[name], atol=DISTRIBUTED_PARAM_ATOL, rtol=0,
                                   msg=name)


def _dcp_model_keys(run_dir: Path) -> set[str]:
    metadata = dcp.FileSystemReader(run_dir / "checkpoint.dcp").read_metadata()
    return {k.removeprefix("model.") for k in metadata.state_dict_metadata
            if k.startswith("model.")}


def test_two_ranks_equal_one_process_and_resume_on_one(tmp_path: Path, base: Path,
                                                       straight: Path) -> None:
    """Steps 1-3 at (dp_shard, ep) = (1, 2) under torchrun, then --resume on one process: the
    losses and adapters equal the straight one-process run; the DCP checkpoint is adapter-only;
    resuming it with other adapter targets is one usage-error line that writes nothing."""
    out = tmp_path / "run"
    _train(tmp_path, out, (1, 2), *LORA, "--init-from", str(base), "--max-steps", "3")
    keys = _dcp_model_keys(out)
    assert keys == {f"blocks.{i}.moe.{name}" for i in range(2) for name in (
        "experts.lora_a_up", "experts.lora_b_up", "experts.lora_a_down", "experts.lora_b_down",
        "router.selection_bias")}, sorted(keys)
    meta = torch.load(out / "checkpoint.dcp" / "meta.pt", weights_only=True)
    assert meta["base"]["checkpoint"] == str((base / "checkpoint.pt").resolve())
    torch.testing.assert_close(_metrics(out, "train_loss"), _metrics(straight, "train_loss")[:3],
                               atol=DISTRIBUTED_LOSS_ATOL, rtol=0)

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = timeouts.run([sys.executable, "-m", "memfine", *COMMON, "--resume", "--max-steps",
                         str(STEPS), "--lora-targets", "w_up", "--ep", "2", "--out", str(out)],
                        RUN_TIMEOUT_S, env={**os.environ, "WORLD_SIZE": "2"},
                        capture_output=True, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"memfine train: error: --lora-targets cannot change on --resume (the checkpoint in "
        f"'{out}' has --lora-targets w_up,w_down, got w_up)")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    _train(tmp_path, out, (1, 1), "--resume", "--max-steps", str(STEPS))
    assert len(_metrics(out, "train_loss")) == STEPS
    _assert_same_lora_run(out, straight)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param((2, 1), id="dp2_ep1"),
                                    pytest.param((1, 2), id="dp1_ep2")])
def test_lora_layout_matches_one_process(tmp_path: Path, base: Path, straight: Path,
                                         layout: tuple[int, int]) -> None:
    """A straight run on 2 ranks; ``memfine export`` reads its adapter-only DCP checkpoint."""
    out = tmp_path / "run"
    _train(tmp_path, out, layout, *LORA, "--init-from", str(base), "--max-steps", str(STEPS))
    assert not (out / "checkpoint.pt").exists()
    _assert_same_lora_run(out, straight)
    assert main(["export", "--out", str(out), "--to", str(tmp_path / "a.safetensors")]) == 0
    model = load_trained(base).model
    load_adapters(model, tmp_path / "a.safetensors")
    want = load_trained(straight).model.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, want[name], atol=DISTRIBUTED_PARAM_ATOL, rtol=0,
                                   msg=name)


@pytest.mark.slow
def test_lora_resume_one_process_to_ranks(tmp_path: Path, base: Path, straight: Path) -> None:
    """A one-file LoRA checkpoint resumes at (1, 2), whose DCP checkpoint resumes at (2, 1)."""
    out = tmp_path / "run"
    _train(tmp_path, out, (1, 1), *LORA, "--init-from", str(base), "--max-steps", "2")
    _train(tmp_path, out, (1, 2), "--resume", "--max-steps", "4")
    _train(tmp_path, out, (2, 1), "--resume", "--max-steps", str(STEPS))
    _assert_same_lora_run(out, straight)


@pytest.fixture(scope="module")
def qlora_straight(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process QLoRA run of QLORA_STEPS steps on ``base`` (in this process)."""
    pytest.importorskip("bitsandbytes", reason="the 4-bit base needs bitsandbytes")
    out = tmp_path_factory.mktemp("qlora") / "run"
    assert main([*COMMON, "--preset", "tiny", *QLORA, "--init-from", str(base), "--max-steps",
                 str(QLORA_STEPS), "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_qlora_two_ranks_equal_one_process_and_resume_on_one(tmp_path: Path, base: Path,
                                                             qlora_straight: Path) -> None:
    """A 4-bit base at (dp_shard, ep) = (1, 2) for 2 steps under torchrun, then --resume on one
    process: losses, gradient norms and adapters equal the one-process 4-bit run."""
    out = tmp_path / "run"
    _train(tmp_path, out, (1, 2), *QLORA, "--init-from", str(base), "--max-steps", "2")
    assert main([*COMMON, "--resume", "--max-steps", str(QLORA_STEPS), "--out", str(out)]) == 0
    _assert_same_lora_run(out, qlora_straight)


@pytest.mark.slow
def test_qlora_default_layout_matches_one_process(tmp_path: Path, base: Path,
                                                  qlora_straight: Path) -> None:
    """A 4-bit base at torchrun's default layout (FSDP2 over both ranks, no ``--ep``)."""
    out = tmp_path / "run"
    _train(tmp_path, out, (2, 1), *QLORA, "--init-from", str(base), "--max-steps",
           str(QLORA_STEPS))
    _assert_same_lora_run(out, qlora_straight)


def test_qlora_experts_become_expert_parallel_in_four_bit() -> None:
    """Sharding a 4-bit-base model (one gloo rank, in process): its MoE layers' experts become
    expert-parallel with the rank's NF4 codes and no full-precision base, and the loss and the
    adapters' gradients equal the unsharded model's (the fast check of the runs above)."""
    pytest.importorskip("bitsandbytes", reason="the 4-bit base needs bitsandbytes")
    torch.manual_seed(0)
    model = MoETransformerLM(preset("tiny").model)
    apply_lora(model, LoRAConfig(rank=4, base_quant="nf4"))
    for name, p in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, 256, (2, 16))
    whole = copy.deepcopy(model)
    want = whole(ids[:, :-1], ids[:, 1:]).loss
    want.backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert shard_model(model, build_context(1, 1)) == 2
        for block in model.blocks:
            experts = block.moe.experts
            assert isinstance(experts, ExpertParallelLoRAExperts) and experts.quant is not None
            assert experts.w_up.numel() == experts.w_down.numel() == 0
        got = model(ids[:, :-1], ids[:, 1:]).loss
        got.backward()
        torch.testing.assert_close(got, want, rtol=SHARDED_LOSS_RTOL, atol=0)
        for block, ref in zip(model.blocks, whole.blocks, strict=True):
            for name in ("lora_a_up", "lora_b_up", "lora_a_down", "lora_b_down"):
                torch.testing.assert_close(getattr(block.moe.experts, name).grad.full_tensor(),
                                           getattr(ref.moe.experts, name).grad,
                                           rtol=SHARDED_GRAD_RTOL, atol=SHARDED_GRAD_ATOL,
                                           msg=name)
    finally:
        dist.destroy_process_group()
