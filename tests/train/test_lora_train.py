"""LoRA fine-tuning in the training loop: adapters only, frozen base, resume (memfine.train).

A tiny run trains every weight; LoRA runs start from its checkpoint (``init_from``) with
``TrainConfig.lora`` set.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from memfine.config import TrainConfig
from memfine.config.lora import LoRAConfig
from memfine.data import ByteCorpus, train_batch, val_batches
from memfine.inference.trained import load_trained
from memfine.nn import MoETransformerLM
from memfine.nn.lora import apply_lora
from memfine.reports.evaluation import evaluate
from memfine.train import preset, train
from memfine.train.parallel import SingleProcess
from memfine.train.setup import build_model
from tolerances import LOSS_ATOL

ASSET = Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt"
ADAPTER_SUFFIXES = ("lora_a_up", "lora_b_up", "lora_a_down", "lora_b_down")


def _config(**overrides: object) -> TrainConfig:
    """The ``tiny`` preset's model on the test corpus: 3 short steps, one validation batch."""
    return dataclasses.replace(preset("tiny"), **{
        "data": str(ASSET), "seq_len": 32, "batch_size": 4, "max_steps": 3, "lr": 3e-3,
        "warmup_steps": 1, "eval_every": 3, "eval_batches": 1, "sample_tokens": 0,
        **overrides})


def _lora(**overrides: object) -> TrainConfig:
    return _config(**{"max_steps": 6, "lr": 1e-2, "lora": LoRAConfig(rank=4, alpha=8.0),
                      **overrides})


def _run(config: TrainConfig, out: Path, **kwargs: object):
    return train(config, out, progress=False, threads=1, **kwargs)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base")
    _run(_config(), out)
    return out


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's whole model state as loaded (a LoRA run's frozen base read from its base)."""
    return load_trained(run_dir).model.state_dict()


def _is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def test_only_the_adapters_change(base: Path, tmp_path: Path) -> None:
    _run(_lora(), tmp_path / "ft", init_from=base)
    before, after = _state(base), _state(tmp_path / "ft")
    frozen = [k for k in after if not _is_adapter(k)]
    assert sorted(frozen) == sorted(before)  # the base's tensors, nothing else but adapters
    for name in frozen:
        assert torch.equal(after[name], before[name]), name  # bitwise
    adapters = [k for k in after if _is_adapter(k)]
    assert len(adapters) == 2 * 4  # two MoE layers, A and B of w_up and w_down
    for name in adapters:
        if "lora_b_" in name:  # B starts at zero; training moved it
            assert after[name].abs().max() > 0, name
    # A moved from its seeded initial value (drawn after the base weights, as in training)
    torch.manual_seed(0)
    fresh = MoETransformerLM(_config().model)
    apply_lora(fresh, LoRAConfig(rank=4, alpha=8.0))
    initial = fresh.state_dict()
    for name in adapters:
        if "lora_a_" in name:
            assert not torch.equal(after[name], initial[name]), name


def test_optimizer_and_gradients_hold_the_adapters_only(base: Path) -> None:
    config = dataclasses.replace(_lora(), lr_decay_steps=6)
    model, optimizer, _ = build_model(config, SingleProcess(), torch.device("cpu"),
                                      init_from=base)
    names = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = sorted(names[id(p)] for g in optimizer.param_groups for p in g["params"])
    assert in_optimizer == sorted(n for n in names.values() if _is_adapter(n))
    corpus = ByteCorpus.load(str(ASSET), val_fraction=0.05, seq_len=32)
    x, y = train_batch(corpus.train_ids, batch_size=4, seq_len=32, seed=0, step=0)
    model(x, y).loss.backward()
    for name, param in model.named_parameters():
        if _is_adapter(name):
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
        else:
            assert param.grad is None, name  # frozen: no gradient buffer


def test_first_loss_is_the_base_models_and_merged_weights_give_the_final_loss(
        base: Path, tmp_path: Path) -> None:
    tuned = _run(_lora(), tmp_path / "ft", init_from=base)
    assert all(torch.isfinite(torch.tensor(tuned.train_losses)))
    # B = 0 at the start: step 1's loss is the base model's on the same batch
    model = MoETransformerLM(_config().model)
    model.load_state_dict(_state(base))
    corpus = ByteCorpus.load(str(ASSET), val_fraction=0.05, seq_len=32)
    x, y = train_batch(corpus.train_ids, batch_size=4, seq_len=32, seed=0, step=0)
    with torch.no_grad():
        base_loss = float(model(x, y).loss)
    assert abs(tuned.train_losses[0] - base_loss) <= LOSS_ATOL
    # the tuned model's validation loss, from a plain model holding W + s·(B·A)ᵀ per expert
    state, scale = _state(tmp_path / "ft"), 8.0 / 4
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            p = f"blocks.{i}.moe.experts."
            block.moe.experts.w_up.copy_(state[p + "w_up"] + scale * torch.einsum(
                "erd,egr->edg", state[p + "lora_a_up"], state[p + "lora_b_up"]))
            block.moe.experts.w_down.copy_(state[p + "w_down"] + scale * torch.einsum(
                "ern,edr->end", state[p + "lora_a_down"], state[p + "lora_b_down"]))
    batches = val_batches(corpus.val_ids, num_batches=1, batch_size=4, seq_len=32)
    assert abs(evaluate(model, batches, torch.device("cpu")) - tuned.final_val_loss) <= LOSS_ATOL
    # and fine-tuning lowered it below the base model's
    base_model = MoETransformerLM(_config().model)
    base_model.load_state_dict(_state(base))
    assert tuned.final_val_loss < evaluate(base_model, batches, torch.device("cpu"))


def test_resume_equals_the_straight_run_with_adapter_dropout(base: Path, tmp_path: Path) -> None:
    config = _lora(lora=LoRAConfig(rank=4, alpha=8.0, dropout=0.2), lr_decay_steps=6)
    straight = _run(config, tmp_path / "straight", init_from=base)
    _run(dataclasses.replace(config, max_steps=3), tmp_path / "split", init_from=base)
    second = _run(config, tmp_path / "split", resume=True)  # no init_from: the checkpoint has all
    assert len(second.train_losses) == 3
    got, want = second.train_losses, straight.train_losses[3:]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOSS_ATOL
    assert abs(second.final_val_loss - straight.final_val_loss) <= LOSS_ATOL


def test_train_router_trains_the_router_and_keeps_attention(base: Path, tmp_path: Path) -> None:
    config = _lora(lora=LoRAConfig(rank=2, train_router=True), max_steps=2)
    _run(config, tmp_path / "ft", init_from=base)
    before, after = _state(base), _state(tmp_path / "ft")
    router = [k for k in before if ".router." in k and k.endswith("weight")]
    assert router and all(not torch.equal(after[k], before[k]) for k in router)
    attention = [k for k in before if ".attn." in k]
    assert attention and all(torch.equal(after[k], before[k]) for k in attention)


def test_lora_without_init_from_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^TrainConfig.lora needs init_from"):
        _run(_lora(), tmp_path / "ft")
    assert not (tmp_path / "ft" / "config.json").exists()


@pytest.mark.parametrize(("lora", "message"), [
    pytest.param(dict(rank=65), r"LoRAConfig.rank must be in \[1, min\(d_in, d_out\)=64\]",
                 id="rank_above_min_d_in_d_out"),
    pytest.param(dict(rank=0), r"LoRAConfig.rank must be >= 1, got 0", id="rank0"),
])
def test_bad_lora_config(lora: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(lora=LoRAConfig(**lora))


def test_lora_needs_the_fused_experts() -> None:
    model = _config().model
    plain = dataclasses.replace(model, moe=dataclasses.replace(model.moe, experts_impl="plain"))
    with pytest.raises(ValueError, match=r"MoEConfig.experts_impl must be 'fused' with LoRA"):
        _config(model=plain, lora=LoRAConfig(rank=2))
