"""Training loop: determinism, resume equality, Ctrl-C, divergence (memfine.train.loop)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from memfine.config import ChunkConfig, ModelConfig, MoEConfig, TrainConfig
from memfine.data import train_batch
from memfine.memory.layer import moe_layer_memory
from memfine.nn import LMOutput, MoETransformerLM
from memfine.reports.metrics import read_metrics
from memfine.train import ByteCorpus, load_checkpoint, train
from tolerances import LOSS_ATOL, assert_close

ASSET = Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt"


def _config(**overrides: object) -> TrainConfig:
    model = ModelConfig(num_layers=2, num_heads=2, max_seq_len=32,
                        moe=MoEConfig(hidden_size=32, intermediate_size=32, num_experts=4,
                                      top_k=2))
    base = TrainConfig(model=model, data=str(ASSET), seq_len=32, batch_size=4, max_steps=8,
                       lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=1, log_every=1,
                       sample_tokens=0)
    return dataclasses.replace(base, **overrides)


def _run(config: TrainConfig, out: Path, **kwargs: object):
    return train(config, out, progress=False, threads=1, **kwargs)


def test_same_seed_gives_identical_losses_other_seed_differs(tmp_path: Path) -> None:
    cfg = _config(max_steps=4)
    a = _run(cfg, tmp_path / "a")
    b = _run(cfg, tmp_path / "b")
    c = _run(dataclasses.replace(cfg, seed=1), tmp_path / "c")
    assert len(a.train_losses) == 4
    assert a.train_losses == b.train_losses  # bitwise
    assert a.final_val_loss == b.final_val_loss
    assert a.train_losses != c.train_losses


def test_interrupt_then_resume_equals_straight_run(tmp_path: Path) -> None:
    cfg = _config()
    straight = _run(cfg, tmp_path / "straight")

    def interrupt_at_3(step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt

    first = _run(cfg, tmp_path / "resumed", on_step=interrupt_at_3)
    assert first.interrupted and first.step == 3 and first.final_val_loss is None
    assert load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")["step"] == 3
    second = _run(cfg, tmp_path / "resumed", resume=True)
    assert not second.interrupted and second.step == 8
    joined = first.train_losses + second.train_losses
    assert len(joined) == len(straight.train_losses)
    for got, want in zip(joined, straight.train_losses, strict=True):
        assert abs(got - want) <= LOSS_ATOL
    assert second.final_val_loss is not None and straight.final_val_loss is not None
    assert abs(second.final_val_loss - straight.final_val_loss) <= LOSS_ATOL
    # metrics.jsonl of the resumed run lists each step once, as the straight run's does
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")]
    assert steps == list(range(1, 9))


def test_keyboard_interrupt_saves_checkpoint_and_leaves_no_temp_file(tmp_path: Path) -> None:
    def interrupt_at_2(step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt

    result = _run(_config(eval_every=100), tmp_path, on_step=interrupt_at_2)
    assert result.interrupted and result.step == 2
    payload = load_checkpoint(tmp_path / "checkpoint.pt")
    assert payload["step"] == 2
    assert TrainConfig.from_dict(payload["config"]) == _config(eval_every=100, lr_decay_steps=8)
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_rejects_a_changed_model(tmp_path: Path) -> None:
    _run(_config(max_steps=2), tmp_path)
    other = _config(max_steps=4, model=dataclasses.replace(_config().model, num_layers=3))
    with pytest.raises(ValueError, match=r"cannot resume .* different \['model'\]"):
        _run(other, tmp_path, resume=True)


def test_outputs_written(tmp_path: Path) -> None:
    result = _run(_config(max_steps=4, sample_tokens=10), tmp_path)
    config = TrainConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert config == _config(max_steps=4, sample_tokens=10, lr_decay_steps=4)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["train_loss"] for r in records] == list(result.train_losses)
    last = records[-1]
    assert last["val_loss"] == result.final_val_loss
    assert last["num_chunks"] == [1, 1]
    assert [sum(c) for c in last["tokens_per_expert"]] == [4 * 32 * 2] * 2  # B·Q·k per layer
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_val_loss_nats_per_byte"] == result.final_val_loss
    assert summary["final_val_loss_bits_per_byte"] == pytest.approx(
        result.final_val_loss / math.log(2))
    assert len((tmp_path / "sample.txt").read_bytes()) > 0


def test_divergence_is_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class NaNFromStep2(MoETransformerLM):
        calls = 0

        def forward(self, *args: object, **kwargs: object) -> LMOutput:
            out = super().forward(*args, **kwargs)
            if self.training:
                type(self).calls += 1
                if type(self).calls >= 2:
                    return dataclasses.replace(out, loss=out.loss * float("nan"))
            return out

    monkeypatch.setattr("memfine.train.setup.MoETransformerLM", NaNFromStep2)
    with pytest.raises(ValueError, match=r"training diverged at step 2: the training loss is "
                                         r"nan; no checkpoint was saved before it"):
        _run(_config(), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing saved: the run's files are removed
    NaNFromStep2.calls = 0
    with pytest.raises(ValueError, match=r"diverged at step 2: .*run/checkpoint.pt keeps step "
                                         r"1, the last good one"):
        _run(_config(save_every=1), tmp_path / "run")
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def _finite(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_checkpoint(path)["model"].values()
               if t.is_floating_point())


def test_a_diverging_step_never_replaces_the_last_good_checkpoint(tmp_path: Path) -> None:
    # lr 1e30: step 1 saves finite (huge) weights; step 2's gradient norm is NaN
    cfg = _config(max_steps=4, eval_every=1, lr=1e30, warmup_steps=0)
    with pytest.raises(ValueError, match=r"^training diverged at step 2: the gradient norm is "
                                         r"nan; no checkpoint is written from it; .*run/"
                                         r"checkpoint.pt keeps step 1, the last good one"):
        _run(cfg, tmp_path / "run")
    path = tmp_path / "run" / "checkpoint.pt"
    assert load_checkpoint(path)["step"] == 1 and _finite(path)


def test_a_diverging_run_closes_its_progress_bar_before_the_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(max_steps=4, eval_every=1, lr=1e30, warmup_steps=0)
    try:
        train(cfg, tmp_path / "run", progress=True, threads=1)
    except ValueError as diverged:  # read the bar's output while the run's frames are alive
        err = capsys.readouterr().err
        assert "diverged at step 2" in str(diverged)
    else:
        pytest.fail("the run did not diverge")
    assert "1/4" in err and err.endswith("\n")  # the bar ended its line: the error gets its own


def test_a_run_diverging_before_a_good_checkpoint_removes_its_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"diverged at step 2: .*no checkpoint was saved before "
                                         r"it .*files this run created are removed"):
        _run(_config(max_steps=2, lr=1e30, warmup_steps=0), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_non_finite_weights_after_a_finite_step_are_never_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an update that overflows a weight although the step's loss and gradient norm were finite:
    # the save's check of the weights stops the run
    step = torch.optim.AdamW.step

    def overflowing_step(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        out = step(self, *args, **kwargs)
        self.param_groups[0]["params"][0].data[0, 0] = math.inf
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    with pytest.raises(ValueError, match=r"diverged at step 1: 1 of \d+ weight tensors are "
                                         r"not finite .*no checkpoint was saved"):
        _run(_config(max_steps=2, save_every=1, eval_every=100), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("fail_at", "left"), [
    pytest.param(1, [], id="before_the_first_checkpoint"),
    pytest.param(3, ["checkpoint.pt", "config.json", "metrics.jsonl"], id="after_one"),
])
def test_a_failed_run_leaves_files_only_with_a_checkpoint(tmp_path: Path, fail_at: int,
                                                          left: list[str]) -> None:
    def fail(step: int) -> None:
        if step == fail_at:
            raise RuntimeError("the device went away")

    with pytest.raises(RuntimeError, match="the device went away"):
        _run(_config(save_every=2), tmp_path / "run", on_step=fail)
    assert sorted(p.name for p in (tmp_path / "run").glob("*")) == left
    if not left:
        assert not (tmp_path / "run").exists()
        _run(_config(max_steps=1), tmp_path / "run")  # the same --out runs again
        assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 1


def test_a_bad_data_path_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        _run(_config(data=str(tmp_path / "missing.txt")), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_diverged_last_update_is_an_error_not_a_sampling_failure(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"training diverged at step 2: the gradient norm is "
                                         r"nan; .*lower --lr"):
        _run(_config(max_steps=2, lr=1e30, warmup_steps=0, grad_clip=0.0, eval_every=100),
             tmp_path / "run")


def test_save_every_sets_the_checkpoint_steps(tmp_path: Path) -> None:
    saved: list[int | None] = []

    def record(step: int) -> None:
        path = tmp_path / "checkpoint.pt"
        saved.append(load_checkpoint(path)["step"] if path.exists() else None)

    _run(_config(save_every=3, eval_every=100), tmp_path, on_step=record)
    assert saved == [None, None, 3, 3, 3, 6, 6, 8]


def test_logged_peak_bytes_measured_and_predicted(tmp_path: Path) -> None:
    cfg = _config(max_steps=2, model=dataclasses.replace(
        _config().model, chunk=ChunkConfig(num_chunks=2)))
    _run(cfg, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    param_bytes = 4 * sum(p.numel() for p in MoETransformerLM(cfg.model).parameters())
    want = moe_layer_memory(cfg.model.moe, 4 * 32, 4, num_chunks=2,
                            recompute="experts").peak_bytes
    for r in records:
        # every gradient is created inside the measured forward + backward (set_to_none before)
        assert r["peak_bytes"] >= param_bytes
        assert r["peak_bytes_predicted"] == [want, want]
        assert r["num_chunks"] == [2, 2]


def test_init_from_starts_from_the_checkpoint_weights(tmp_path: Path) -> None:
    _run(_config(max_steps=3), tmp_path / "base")
    other = tmp_path / "other.txt"
    other.write_bytes(ASSET.read_bytes()[::-1])  # new data: the same text reversed
    tuned = _run(_config(max_steps=1, data=str(other)), tmp_path / "tuned",
                 init_from=tmp_path / "base")
    model = MoETransformerLM(_config().model)
    model.load_state_dict(load_checkpoint(tmp_path / "base" / "checkpoint.pt")["model"])
    corpus = ByteCorpus.load(str(other), val_fraction=0.05, seq_len=32)
    x, y = train_batch(corpus.train_ids, batch_size=4, seq_len=32, seed=0, step=0)
    with torch.no_grad():
        direct = float(model(x, y).loss)
    assert abs(tuned.train_losses[0] - direct) <= LOSS_ATOL
    with pytest.raises(ValueError, match=r"its model differs in num_layers \(2 there, 3 here\)"):
        _run(_config(model=dataclasses.replace(_config().model, num_layers=3)),
             tmp_path / "bad", init_from=tmp_path / "base")
    # the run's own settings of the same architecture: the same weights, chunked in two
    model_config = _config().model
    chunked = dataclasses.replace(model_config, chunk=dataclasses.replace(model_config.chunk,
                                                                          num_chunks=2))
    tuned = _run(_config(max_steps=1, data=str(other), model=chunked), tmp_path / "chunked",
                 init_from=tmp_path / "base")
    assert abs(tuned.train_losses[0] - direct) <= LOSS_ATOL


def test_missing_plot_package_stops_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> object:
        raise ImportError(f"{name} is required for this feature: pip install 'memfine[train]'")

    monkeypatch.setattr("memfine.reports.outputs.require", missing)
    with pytest.raises(ImportError, match="matplotlib is required"):
        _run(_config(), tmp_path / "run", plot=True)
    assert not (tmp_path / "run").exists()


def test_tensorboard_gets_the_logged_losses(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = _run(_config(max_steps=3), tmp_path, tensorboard=True)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [e.value for e in events.Scalars("train_loss")]
    assert got == pytest.approx(list(result.train_losses), abs=1e-6)  # stored as float32


def test_selection_bias_moves_once_per_step_from_the_steps_counts(tmp_path: Path) -> None:
    gamma = 1e-3
    moe = dataclasses.replace(_config().model.moe, bias_update_rate=gamma)
    config = _config(max_steps=3, model=dataclasses.replace(_config().model, moe=moe))
    _run(config, tmp_path)
    expected = torch.zeros(2, 4, dtype=torch.float64)
    records = read_metrics(tmp_path / "metrics.jsonl")
    for rec in records:  # log_every = 1: each record holds that step's (L, E) counts
        load = torch.tensor(rec["tokens_per_expert"], dtype=torch.float64)
        expected += torch.sign(load.mean(-1, keepdim=True) - load) * gamma
    state = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    got = torch.stack([state[f"blocks.{i}.moe.router.selection_bias"] for i in range(2)])
    assert len(records) == 3 and bool(expected.ne(0).any())
    assert_close(got, expected.float())  # fp32 sums of ±γ


def test_capacity_drops_are_logged(tmp_path: Path) -> None:
    moe = dataclasses.replace(_config().model.moe, capacity_factor=0.5)
    config = _config(max_steps=2, model=dataclasses.replace(_config().model, moe=moe))
    _run(config, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    T, k, E = 4 * 32, 2, 4
    capacity = -(-T * k // (2 * E))  # ceil(0.5·T·k/E) = 32; an expert gets 64 pairs on average
    for rec in records:
        kept = torch.tensor(rec["tokens_per_expert"])
        assert bool((kept <= capacity).all())
        assert (kept.sum(-1) + torch.tensor(rec["dropped_pairs"])).tolist() == [T * k] * 2


def test_the_output_names_config_json_and_ends_with_where_everything_went(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(_config(max_steps=2), tmp_path / "run")
    lines = capsys.readouterr().out.splitlines()
    assert f"config: {tmp_path / 'run' / 'config.json'} (every setting of the run)" in lines
    assert not any(line.startswith(("{", '  "')) for line in lines)  # no JSON dump
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert lines[-1] == (
        f"done: final validation loss {result.final_val_loss:.4f} nats/byte = "
        f"{result.final_val_loss / math.log(2):.4f} bits/byte, "
        f"{abs(summary['percent_below_unigram']):.1f}% "
        f"{'below' if summary['percent_below_unigram'] >= 0 else 'above'} the unigram baseline; "
        f"everything is in {tmp_path / 'run'}/: checkpoint.pt, config.json, metrics.jsonl, "
        f"sample.txt, summary.json")
