"""examples/hf_finetune.py: the HF Trainer recipe runs end to end and writes its CSV.

A two-step run of the example's ``main`` on a tiny GPT-OSS (biases, clamped SwiGLU) with eager
and memfine experts, from the same weights and batches, under the Trainer's gradient
checkpointing and bf16 autocast on the CPU.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import timeouts
from tolerances import assert_close

for _package in ("transformers", "accelerate"):
    pytest.importorskip(_package, reason=f"{_package} is not installed: pip install -e '.[hf]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_finetune.py"
METRICS = {"time": "ms", "peak_bytes": "bytes", "profiled_peak_bytes": "bytes",
           "saved_bytes": "bytes",
           "first_loss": "nats/byte", "final_loss": "nats/byte"}


def _example(name: str = "hf_finetune") -> Any:
    """examples/<name>.py loaded as a module (trl_sft's flags parse without trl)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLE.with_stem(name))
    assert spec is not None and spec.loader is not None, f"examples/{name}.py is missing"
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_trainer_recipe_runs_and_writes_the_csv(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    example = _example()
    out = tmp_path / "hf_finetune.csv"
    monkeypatch.setattr(sys, "argv", [
        "hf_finetune.py", "--models", "gpt_oss", "--impls", "eager,memfine", "--steps", "3",
        "--batch-size", "2", "--seq-len", "32", "--hidden-size", "32",
        "--moe-intermediate-size", "16", "--num-experts", "4", "--csv", str(out)])
    threads = torch.get_num_threads()
    try:
        example.main()
    finally:
        torch.set_num_threads(threads)
    with out.open() as f:
        rows = {(r["method"], r["metric"]): r for r in csv.DictReader(f)}
    assert set(rows) == {(impl, metric) for impl in ("eager", "memfine") for metric in METRICS}
    for (impl, metric), row in rows.items():
        assert row["unit"] == METRICS[metric] and row["x_value"] == "gpt_oss", (impl, metric)
        assert float(row["p50"]) > 0, (impl, metric)
    first = {impl: float(rows[impl, "first_loss"]["p50"]) for impl in ("eager", "memfine")}
    # Same weights and batch: the first loss agrees within bf16 rounding.
    assert_close(torch.tensor(first["memfine"]), torch.tensor(first["eager"]),
                 dtype=torch.bfloat16)


def test_too_few_steps_to_measure_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    monkeypatch.setattr(sys, "argv", ["hf_finetune.py", "--steps", "2"])
    with pytest.raises(SystemExit) as info:
        example.parse_args()
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "hf_finetune.py: error: argument --steps: expected an integer >= 3, got 2\n")


@pytest.mark.parametrize(("name", "args", "message"), [
    ("hf_finetune", ["--models", "qwen3_moe,nope"], "argument --models: expected "
     "comma-separated names from qwen3_moe, gpt_oss, mixtral, got 'qwen3_moe,nope'"),
    ("hf_finetune", ["--impls", "fast"], "argument --impls: expected comma-separated names "
     "from eager, batched_mm, grouped_mm, memfine, got 'fast'"),
    ("hf_finetune", ["--top-k", "0"], "argument --top-k: expected an integer >= 1, got 0"),
    ("hf_finetune", ["--top-k", "9"], "--top-k must be at most --num-experts 8, got 9"),
    ("hf_finetune", ["--layers", "3"], "--layers must be even with gpt_oss in --models "
     "(GPT-OSS alternates sliding and full attention layers), got 3"),
    ("hf_finetune", ["--models", "mixtral,gpt_oss", "--layers", "1"], "--layers must be even "
     "with gpt_oss in --models (GPT-OSS alternates sliding and full attention layers), got 1"),
    ("hf_finetune", ["--steps", "0"], "argument --steps: expected an integer >= 3, got 0"),
    ("hf_finetune", ["--csv", "/proc/nope/x.csv"], "argument --csv: cannot write "
     "'/proc/nope/x.csv': no file can be made in '/proc' (No such file or directory)"),
    ("hf_finetune", ["--layers", "two"], "argument --layers: expected an integer, got 'two'"),
    ("hf_finetune", ["--moe-intermediate-size", "30"], "--impls grouped_mm needs --hidden-size "
     "and --moe-intermediate-size multiples of 8 (torch._grouped_mm takes bf16 rows of 16-byte "
     "multiples), got --moe-intermediate-size 30; leave grouped_mm out of --impls"),
    ("trl_sft", ["--models", "mixtral,llama"], "argument --models: expected comma-separated "
     "names from qwen3_moe, gpt_oss, mixtral, got 'mixtral,llama'"),
    ("trl_sft", ["--top-k", "33"], "--top-k must be at most --num-experts 32, got 33"),
    ("trl_sft", ["--layers", "0"], "argument --layers: expected an integer >= 1, got 0"),
    ("trl_sft", ["--lm-head-tile", "-1"], "argument --lm-head-tile: expected an integer >= 0, "
     "got -1"),
    ("trl_sft", ["--steps", "3"], "argument --steps: expected an integer >= 4, got 3"),
    ("trl_sft", ["--csv", "."], "argument --csv: expected a CSV file's path, got '.' (a folder)"),
])
def test_bad_flags_are_one_usage_line(name: str, args: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _example(name).parse_args(args)
    assert info.value.code == 2
    prog, _, rest = capsys.readouterr().err.partition(": ")
    assert " " not in prog and rest == f"error: {message}\n"  # one line, no usage block


def test_unaligned_sizes_parse_without_grouped_mm() -> None:
    args = _example("hf_finetune").parse_args(["--moe-intermediate-size", "30", "--hidden-size",
                                                "60", "--impls", "eager,memfine"])
    assert (args.hidden_size, args.moe_intermediate_size) == (60, 30)


def test_odd_layers_without_gpt_oss_and_a_writable_csv_parse(tmp_path: Path) -> None:
    args = _example().parse_args(["--models", "qwen3_moe", "--layers", "3",
                                  "--csv", str(tmp_path / "new" / "x.csv")])
    assert (args.layers, args.csv) == (3, str(tmp_path / "new" / "x.csv"))
    assert list(tmp_path.iterdir()) == []  # nothing written up front


def test_help_lists_every_model_and_shows_the_defaults(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit) as info:
        _example().parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "from qwen3_moe, gpt_oss, mixtral (default: qwen3_moe,gpt_oss)" in text
    assert ("optimizer steps, >= 3 (step 1 is tracked, step 2 profiled) (default: 12)" in text
            and "k, at most E (default: 2)" in text)
    assert _example().parse_args(["--models", "mixtral"]).models == ["mixtral"]
    with pytest.raises(SystemExit):
        _example("trl_sft").parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: qwen3_moe,gpt_oss,mixtral)" in text and "optimizer steps, >= 4 (" in text


def test_the_trainer_import_prints_no_bitsandbytes_note() -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import hf_finetune; "
            "hf_finetune.import_trainer(); import peft, transformers.trainer")
    proc = timeouts.run([sys.executable, "-c", code, str(EXAMPLE.parent)], 120,
                        capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stdout + proc.stderr


def test_checkpointing_takes_the_name_training_arguments_declares() -> None:
    """activation_checkpointing where TrainingArguments has it (no deprecation warning),
    gradient_checkpointing on a transformers without it."""
    import dataclasses
    import warnings

    from transformers import TrainingArguments

    checkpointing_args = _example().checkpointing_args

    @dataclasses.dataclass
    class Older:
        gradient_checkpointing: bool = False
        gradient_checkpointing_kwargs: dict[str, Any] | None = None

    assert checkpointing_args(Older) == {"gradient_checkpointing": True,
                                         "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    kwargs = checkpointing_args(TrainingArguments)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        made = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **kwargs)
    key = next(iter(kwargs))
    assert getattr(made, key) is True
