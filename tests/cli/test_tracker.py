"""``memfine train --tracker``: the scalars of metrics.jsonl reach TensorBoard, trackio, wandb."""

from __future__ import annotations

import glob
import json
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from memfine.cli.main import main
from memfine.reports.metrics import TRACKER_SCALARS, read_metrics

CORPUS = str(Path(__file__).parents[1] / "assets" / "pydoc_topics_sample.txt")
FAST = ["--preset", "tiny", "--data", CORPUS, "--no-progress", "--threads", "1",
        "--max-steps", "3"]


def _expected(out: Path) -> list[dict[str, Any]]:
    """The tracked scalars of each metrics.jsonl line, with its step."""
    return [{"step": r["step"], **{k: r[k] for k in TRACKER_SCALARS if k in r}}
            for r in read_metrics(out / "metrics.jsonl")]


def _wandb_history(path: str) -> list[dict[str, Any]]:
    """History rows of an offline wandb run file (LevelDB log blocks of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, block, pending, rows = Path(path).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or kind == 0:  # block trailer or padding
            pos += left
            continue
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):  # FIRST / MIDDLE: the record continues
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})
    return rows


def test_wandb_offline_run_gets_the_scalars_of_every_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'memfine[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main(["train", *FAST, "--tracker", "wandb", "--out", str(out)]) == 0
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = [{"step": r.pop("_step"), **{k: v for k, v in r.items() if not k.startswith("_")}}
            for r in _wandb_history(run_file)]
    assert rows == _expected(out)
    assert len(rows) == 3 and "val_loss" in rows[-1]


def test_trackio_gets_the_scalars_of_every_line(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    stub = types.ModuleType("trackio")
    stub.init = lambda **kwargs: calls.append(("init", kwargs))  # type: ignore[attr-defined]
    stub.log = lambda scalars, step: calls.append(("log", {"step": step, **scalars}))  # type: ignore[attr-defined]  # noqa: E501
    stub.finish = lambda: calls.append(("finish", None))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trackio", stub)
    out = tmp_path / "run"
    assert main(["train", *FAST, "--tracker", "trackio", "--out", str(out)]) == 0
    (kind, init), *logs, finish = calls
    assert kind == "init" and init["project"] == "memfine" and init["name"] == "run"
    assert init["config"] == json.loads((out / "config.json").read_text())
    assert [entry for _, entry in logs] == _expected(out)
    assert finish == ("finish", None)


@pytest.mark.parametrize("tracker", ["tensorboard", "trackio", "wandb"])
def test_missing_tracker_package_is_one_line_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tracker: str) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # import raises ModuleNotFoundError
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--tracker", tracker, "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"memfine train: error: --tracker {tracker}: {tracker} is required for this "
                   f"feature: pip install 'memfine[{tracker}]'\n")
    assert not out.exists()


def test_tensorboard_flag_is_the_tensorboard_tracker(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["train", *FAST, "--tensorboard", "--out", str(out)]) == 0
    assert "--tensorboard is deprecated; use --tracker tensorboard" in capsys.readouterr().out
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    got = [e.value for e in events.Scalars("train_loss")]
    assert got == pytest.approx([r["train_loss"] for r in _expected(out)], abs=1e-6)


def test_tensorboard_flag_with_another_tracker_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", *FAST, "--tensorboard", "--tracker", "wandb", "--out", str(out)])
    assert info.value.code == 2
    assert "--tensorboard is --tracker tensorboard, which conflicts with --tracker wandb" in (
        capsys.readouterr().err)
    assert not out.exists()
