"""Adapter-only LoRA checkpoints: trained state plus a hashed reference to the frozen base."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from memfine.artifacts.checkpoint import LoRABaseError, load_checkpoint
from memfine.artifacts.lora_base import content_hash
from memfine.artifacts.weights import language_model, load_weights
from memfine.config.lora import LoRAConfig
from memfine.inference.trained import load_trained
from memfine.nn import MoETransformerLM
from memfine.train import preset, train

ASSET = Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt"


def _config(**overrides: object):
    return dataclasses.replace(preset("tiny"), **{
        "data": str(ASSET), "seq_len": 32, "batch_size": 4, "max_steps": 2, "lr": 3e-3,
        "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "sample_tokens": 0,
        **overrides})


def _run(config, out: Path, **kwargs: object):
    return train(config, out, progress=False, threads=1, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_ckpt")
    _run(_config(), root / "base")
    _run(_config(max_steps=2, lora=LoRAConfig(rank=2)), root / "ft", init_from=root / "base")
    return root / "base", root / "ft"


def test_checkpoint_holds_trained_state_and_the_base_reference(runs: tuple[Path, Path]) -> None:
    base, ft = runs
    payload = load_checkpoint(ft / "checkpoint.pt")
    params = {n for n, _ in MoETransformerLM(_config().model).named_parameters()}
    saved = set(payload["model"])
    assert not saved & params  # no frozen base parameter is repeated
    assert any("lora_a_up" in k for k in saved) and all(
        "lora_" in k or k.endswith("selection_bias") for k in saved)
    ckpt = (base / "checkpoint.pt").resolve()
    sha = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert payload["base"] == {"run_dir": str(base.resolve()), "checkpoint": str(ckpt),
                               "sha256": sha, "copy": f"{sha[:16]}.pt"}
    kept = ft / "lora_base" / f"{sha[:16]}.pt"  # the base's bytes, kept in the LoRA run
    assert kept.read_bytes() == ckpt.read_bytes()
    assert kept.stat().st_ino == ckpt.stat().st_ino  # a hard link: no second copy on disk
    assert (ft / "checkpoint.pt").stat().st_size < (base / "checkpoint.pt").stat().st_size / 3
    # loading reads the base: every base tensor bitwise, the adapters from the run
    whole = load_trained(ft).model.state_dict()
    base_state = load_checkpoint(ckpt)["model"]
    for name in params:
        assert torch.equal(whole[name], base_state[name]), name
    for name, tensor in payload["model"].items():
        assert torch.equal(whole[name], tensor), name


def _copy_runs(runs: tuple[Path, Path], tmp_path: Path) -> dict[str, Any]:
    """Copy both runs into ``tmp_path``, the LoRA one pointing at the copied base.

    The LoRA run's kept base (``lora_base/``) is left out: it reads the base run, as a
    checkpoint written before bases were kept does.

    Returns:
        The copied LoRA checkpoint's payload.
    """
    for run in runs:
        shutil.copytree(run, tmp_path / run.name, ignore=shutil.ignore_patterns("lora_base"))
    payload = load_checkpoint(tmp_path / "ft" / "checkpoint.pt")
    payload["base"] = {"run_dir": str(tmp_path / "base"),
                       "checkpoint": str(tmp_path / "base" / "checkpoint.pt"),
                       "sha256": payload["base"]["sha256"]}
    torch.save(payload, tmp_path / "ft" / "checkpoint.pt")
    return payload


def _change_weights(run: Path) -> str:
    """Add 1 to the first tensor of ``run``'s checkpoint; its new content hash."""
    state = load_checkpoint(run / "checkpoint.pt")
    first = next(iter(state["model"]))
    state["model"][first] = state["model"][first] + 1
    torch.save(state, run / "checkpoint.pt")
    return content_hash(run / "checkpoint.pt")


def test_resume_continues_and_a_changed_base_is_one_line(runs: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    payload = _copy_runs(runs, tmp_path)
    config = _config(max_steps=3, lora=LoRAConfig(rank=2))
    resumed = _run(config, tmp_path / "ft", resume=True)
    assert len(resumed.train_losses) == 1
    sha = payload["base"]["sha256"]  # resume keeps the base it read, from now on
    assert load_checkpoint(tmp_path / "ft" / "checkpoint.pt")["base"] == {
        **payload["base"], "copy": f"{sha[:16]}.pt"}
    assert content_hash(tmp_path / "ft" / "lora_base" / f"{sha[:16]}.pt") == sha
    shutil.rmtree(tmp_path / "ft" / "lora_base")  # without it: the base run is read
    # the base's checkpoint changes: resume and loading refuse in one line
    now = _change_weights(tmp_path / "base")
    assert now != payload["base"]["sha256"]
    message = (f"checkpoint '{tmp_path / 'ft' / 'checkpoint.pt'}': its LoRA base run "
               f"'{tmp_path / 'base'}' changed since the adapters were trained: the base "
               f"checkpoint '{tmp_path / 'base' / 'checkpoint.pt'}' had sha256 "
               f"{payload['base']['sha256'][:12]}…, now {now[:12]}…; restore it, or start a new "
               f"run with --init-from")
    with pytest.raises(LoRABaseError) as err:
        _run(_config(max_steps=4, lora=LoRAConfig(rank=2)), tmp_path / "ft", resume=True)
    assert str(err.value) == message  # the base changed, not the checkpoint's config
    with pytest.raises(LoRABaseError) as err:
        load_trained(tmp_path / "ft")
    assert str(err.value) == message
    # a base checkpoint replaced by an empty directory is named as such, not hashed as empty
    (tmp_path / "base" / "checkpoint.pt").unlink()
    (tmp_path / "base" / "checkpoint.pt").mkdir()
    with pytest.raises(LoRABaseError) as err:
        load_trained(tmp_path / "ft")
    assert str(err.value) == (
        f"checkpoint '{tmp_path / 'ft' / 'checkpoint.pt'}': the LoRA base checkpoint "
        f"'{tmp_path / 'base' / 'checkpoint.pt'}' is now an empty directory; this run's "
        f"checkpoint holds only the adapters (restore the base run)")


def test_stacked_adapters_name_the_checkpoint_whose_base_changed(runs: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    """LoRA on a LoRA run (``stacked`` on ``ft`` on ``base``): ``base`` changes.

    The message says that ``stacked``'s base is ``ft``, a LoRA run whose own base changed, and
    names that base's checkpoint and hashes, not ``stacked`` as the run whose base changed.
    """
    payload = _copy_runs(runs, tmp_path)
    ft, stacked = tmp_path / "ft", tmp_path / "stacked"
    config = _config(lora=LoRAConfig(rank=2))
    _run(config, stacked, init_from=ft)
    load_trained(stacked)  # the unchanged chain loads
    now = _change_weights(tmp_path / "base")
    changed = (f"its LoRA base run '{tmp_path / 'base'}' changed since the adapters were "
               f"trained: the base checkpoint '{tmp_path / 'base' / 'checkpoint.pt'}' had "
               f"sha256 {payload['base']['sha256'][:12]}…, now {now[:12]}…; restore it, or start "
               f"a new run with --init-from")
    with pytest.raises(LoRABaseError) as err:
        load_trained(stacked)
    kept = stacked / "lora_base" / f"{content_hash(ft / 'checkpoint.pt')[:16]}.pt"
    assert str(err.value) == (f"checkpoint '{stacked / 'checkpoint.pt'}': its LoRA base run "
                              f"'{ft.resolve()}' is a LoRA run too; checkpoint "
                              f"'{kept}': {changed}")
    # --init-from the LoRA run: the message names the checkpoint whose base changed
    with pytest.raises(LoRABaseError) as err:
        load_weights(language_model(_config()), config.model, ft)
    assert str(err.value) == f"checkpoint '{ft / 'checkpoint.pt'}': {changed}"


def _state(run: Path) -> dict[str, torch.Tensor]:
    return load_trained(run).model.state_dict()


def test_a_lora_run_survives_its_base_resumed_overwritten_and_deleted(tmp_path: Path) -> None:
    base, ft = tmp_path / "base", tmp_path / "ft"
    _run(_config(), base)
    lora = _config(lora=LoRAConfig(rank=2))
    _run(lora, ft, init_from=base)
    before = _state(ft)
    _run(_config(max_steps=3), base, resume=True)  # the base run moves on
    assert load_checkpoint(base / "checkpoint.pt")["step"] == 3
    after = _state(ft)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base it trained on
    _run(_config(seed=1), base, overwrite=True)  # replaced by another run
    assert all(torch.equal(_state(ft)[k], v) for k, v in before.items())
    shutil.rmtree(base)  # and gone
    assert all(torch.equal(_state(ft)[k], v) for k, v in before.items())
    resumed = _run(dataclasses.replace(lora, max_steps=3), ft, resume=True)
    assert resumed.step == 3 and math.isfinite(resumed.final_val_loss or math.nan)


def test_a_stacked_lora_run_survives_both_bases_deleted(tmp_path: Path) -> None:
    base, ft, stacked = tmp_path / "base", tmp_path / "ft", tmp_path / "stacked"
    _run(_config(), base)
    lora = _config(lora=LoRAConfig(rank=2))
    _run(lora, ft, init_from=base)
    _run(lora, stacked, init_from=ft)
    before = _state(stacked)
    shutil.rmtree(base)
    shutil.rmtree(ft)
    assert all(torch.equal(_state(stacked)[k], v) for k, v in before.items())


def test_the_base_is_copied_where_no_hard_link_can_be_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    base, ft = tmp_path / "base", tmp_path / "ft"
    _run(_config(), base)
    monkeypatch.setattr("memfine.artifacts.lora_base.os.link", no_link)
    _run(_config(lora=LoRAConfig(rank=2)), ft, init_from=base)
    sha = content_hash(base / "checkpoint.pt")
    kept = ft / "lora_base" / f"{sha[:16]}.pt"
    assert kept.stat().st_ino != (base / "checkpoint.pt").stat().st_ino
    assert content_hash(kept) == sha
    # a kept copy whose bytes changed is refused, not used
    payload = load_checkpoint(kept)
    payload["model"]["embed.weight"] += 1
    torch.save(payload, kept)
    with pytest.raises(LoRABaseError, match=r"the kept copy .*lora_base.* changed"):
        load_trained(ft)


def test_a_sharded_base_is_kept_file_by_file(tmp_path: Path) -> None:
    """A torchrun run's ``checkpoint.dcp/`` as the base: every file of it is kept."""
    from memfine.artifacts.checkpoint import SHARDED_NAME, save_sharded_checkpoint
    from memfine.train.optim import build_optimizer

    base, ft = tmp_path / "base", tmp_path / "ft"
    _run(_config(), base)
    trained = load_trained(base)
    model = trained.model.train()
    optimizer, scheduler = build_optimizer(model, trained.config)
    save_sharded_checkpoint(base / SHARDED_NAME, step=trained.step,
                            config=trained.config.to_dict(), model=model, optimizer=optimizer,
                            scheduler=scheduler, is_main=True, barrier=lambda: None)
    assert not (base / "checkpoint.pt").exists()
    _run(_config(lora=LoRAConfig(rank=2)), ft, init_from=base)
    sha = content_hash(base / SHARDED_NAME)
    kept = ft / "lora_base" / f"{sha[:16]}.dcp"
    assert kept.is_dir() and content_hash(kept) == sha
    before = _state(ft)
    shutil.rmtree(base)
    assert all(torch.equal(_state(ft)[k], v) for k, v in before.items())
    assert all(torch.equal(before[k], v) for k, v in trained.model.state_dict().items())
