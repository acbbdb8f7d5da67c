"""examples/long_tail: the modulator's mixture vs a float64 loop, the split, and one short run."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tolerances import assert_close

for _package in ("sklearn", "matplotlib"):
    pytest.importorskip(_package, reason=f"{_package} is not installed: "
                                         "pip install -e '.[examples]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_tail"
GROUPS = ((0, 1, 2), (3, 4, 5), (6, 7, 8, 9))


def _load_run() -> ModuleType:
    """Import examples/long_tail/run.py (it puts its folder on sys.path for its siblings)."""
    spec = importlib.util.spec_from_file_location("long_tail_run", EXAMPLE / "run.py")
    assert spec is not None and spec.loader is not None, "examples/long_tail/run.py is missing"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


run = _load_run()
modulator = importlib.import_module("modulator")
longtail_data = importlib.import_module("longtail_data")
longtail_report = importlib.import_module("longtail_report")


def _modulator_f64() -> torch.nn.Module:
    model = modulator.ModulatorClassifier(GROUPS, num_pixels=7, hidden_size=5).double()
    with torch.no_grad():
        model.router.weight.normal_()  # unit-scale group logits, not N(0, 0.02²)
    return model


def test_mixture_equals_sum_over_groups_float64() -> None:
    model = _modulator_f64()
    x_BP = torch.randn(11, 7, dtype=torch.float64)
    out = model(x_BP)
    h_BH = model.features(x_BP)
    group_probs_BG = (h_BH @ model.router.weight.T).softmax(-1)
    expected_BC = torch.zeros(11, 10, dtype=torch.float64)
    for g, classes in enumerate(GROUPS):  # Σ_g P(g | x) · P(c | x, head g), zero outside g
        head_probs = model.heads[g](h_BH).softmax(-1)
        for j, c in enumerate(classes):
            expected_BC[:, c] += group_probs_BG[:, g] * head_probs[:, j]
    assert_close(out.group_probs_BG, group_probs_BG)
    assert_close(out.group_probs_BG.sum(-1), torch.ones(11, dtype=torch.float64))
    assert_close(out.class_log_probs_BC.exp(), expected_BC)
    assert_close(out.class_log_probs_BC.exp().sum(-1), torch.ones(11, dtype=torch.float64))
    y_B = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
    nll = -expected_BC[torch.arange(11), y_B].log().mean()
    assert_close(model.loss(x_BP, y_B), nll)  # group CE + own head CE == mixture NLL


def test_top1_prediction_uses_the_most_probable_group_only() -> None:
    model = _modulator_f64()
    out = model(torch.randn(32, 7, dtype=torch.float64))
    pred_B = model.predict_top1(out)
    for b in range(32):
        g = int(out.group_probs_BG[b].argmax())
        head_log_probs = out.head_log_probs_BC[b, list(GROUPS[g])]
        assert int(pred_B[b]) == GROUPS[g][int(head_log_probs.argmax())]


def test_heads_learn_only_from_their_group() -> None:
    model = _modulator_f64()
    y_B = torch.tensor([0, 2, 1, 0])  # all "many"
    model.loss(torch.randn(4, 7, dtype=torch.float64), y_B).backward()
    assert model.heads[0].weight.grad.abs().sum() > 0
    for head in model.heads[1:]:  # unused heads get exact zero grads, not None
        assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))


def test_logit_adjustment_hand_value() -> None:
    logits_BC = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
    prior_C = torch.tensor([0.8, 0.2], dtype=torch.float64)
    adjusted = modulator.logit_adjusted(logits_BC, prior_C, tau=1.0)
    assert_close(adjusted, torch.tensor([[2.0 - math.log(0.8), 1.0 - math.log(0.2)]],
                                        dtype=torch.float64))
    assert int(adjusted.argmax()) == 1  # the rare class wins after adjustment
    with pytest.raises(ValueError, match="tau must be >= 0, got -1"):
        modulator.logit_adjusted(logits_BC, prior_C, tau=-1.0)


def test_exponential_profile_and_groups() -> None:
    # 118 · 50^(-c/9), floored: 118, 76.4, 49.5, 32.0, 20.7, 13.4, 8.7, 5.6, 3.6, 2.4
    counts = longtail_data.exponential_counts(118, 10, 50.0)
    assert counts == [118, 76, 49, 32, 20, 13, 8, 5, 3, 2]
    assert longtail_data.exponential_counts(7, 3, 1.0) == [7, 7, 7]
    assert longtail_data.assign_groups(counts, many_min=40, few_below=10) == [0] * 3 + [1] * 3 \
        + [2] * 4
    with pytest.raises(ValueError, match="group 'medium' has no class"):
        longtail_data.assign_groups([50, 40, 5], many_min=40, few_below=10)
    with pytest.raises(ValueError, match="imbalance_ratio must be >= 1, got 0.5"):
        longtail_data.exponential_counts(10, 3, 0.5)


def test_split_is_balanced_disjoint_and_long_tailed() -> None:
    y_N = torch.arange(10).repeat_interleave(30)
    x_NP = torch.arange(300, dtype=torch.float32)[:, None]  # pixel = image id
    split = longtail_data.make_split(x_NP, y_N, seed=3, imbalance_ratio=10.0, test_per_class=5,
                                     many_min=12, few_below=5)
    assert torch.equal(torch.bincount(split.y_test_N), torch.full((10,), 5))
    assert split.train_counts_C.tolist() == longtail_data.exponential_counts(25, 10, 10.0)
    train_ids = split.x_train_NP.flatten().long()
    assert not set(train_ids.tolist()) & set(split.x_test_NP.flatten().long().tolist())
    assert torch.equal(y_N[train_ids], split.y_train_N)  # each image keeps its label
    assert torch.equal(y_N[split.x_test_NP.flatten().long()], split.y_test_N)
    with pytest.raises(ValueError, match=r"test_per_class must be in \[1, 29\]"):
        longtail_data.make_split(x_NP, y_N, seed=0, imbalance_ratio=10.0, test_per_class=30,
                                 many_min=12, few_below=5)


def test_bad_inputs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="groups must be non-empty, disjoint"):
        modulator.ModulatorClassifier(((0, 1), (1, 2)), num_pixels=4, hidden_size=3)
    with pytest.raises(ValueError, match="TrainConfig.epochs must be >= 1, got 0"):
        modulator.TrainConfig(epochs=0)
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="must contain the lines"):
        longtail_report.replace_readme_section(readme, "table")
    assert readme.read_text() == "no markers\n"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--epochs", "0"], "argument --epochs: expected an integer >= 1, got 0"),
    (["--imbalance-ratio", "0"], "argument --imbalance-ratio: expected a number >= 1, "
                                 "got '0'"),
    (["--lr", "-1"], "argument --lr: expected a number > 0, got '-1'"),
    (["--few-below", "50"], "--few-below must be <= --many-min (40), got 50"),
], ids=["epochs", "imbalance_ratio", "lr", "few_below"])
def test_bad_flag_values_are_one_line_errors(argv: list[str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run.parse_args(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {expected}")


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {modulator.TrainConfig().epochs})" in text
    assert f"(default: {run.DataConfig().imbalance_ratio})" in text


def test_example_runs_one_seed(tmp_path: Path, one_thread: None) -> None:
    readme = tmp_path / "README.md"
    shutil.copy(EXAMPLE / "README.md", readme)
    out = tmp_path / "out"
    (seed_run,) = run.main(["--seeds", "1", "--epochs", "15", "--out", str(out),
                            "--readme", str(readme)])
    split = seed_run.split
    with torch.no_grad():
        result = seed_run.modulator(split.x_test_NP)
    assert_close(result.group_probs_BG.sum(-1), torch.ones(split.y_test_N.numel()))
    true_group_N = split.group_of_class_C[split.y_test_N]
    group_acc = (result.group_probs_BG.argmax(-1) == true_group_N).double().mean().item()
    majority_rate = torch.bincount(true_group_N).max().item() / true_group_N.numel()
    assert majority_rate == pytest.approx(0.4)  # few: 4 of 10 classes, balanced test split
    assert group_acc > majority_rate
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == (len(run.MODELS) + 1) * 4
    reported = {(r["model"], r["metric"]): float(r["value_pct"]) for r in rows}
    assert reported[(run.GROUP_ROUTING, "overall")] == pytest.approx(100 * group_acc, abs=1e-4)
    text = readme.read_text()
    assert "(not run yet)" not in text
    assert all(f"| {model} |" in text for model in run.MODELS)
    assert text.count(longtail_report.README_BEGIN) == 1
    assert "![test accuracy per group](out/accuracy.png)" in text  # relative to the README
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_defaults_write_to_a_git_ignored_folder_and_no_readme() -> None:
    args = run.parse_args([])
    assert args.out == Path("runs/long_tail") and args.readme == ""
    root = EXAMPLE.parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(args.out / "results.csv")],
                             cwd=root, check=False)
    assert ignored.returncode == 0  # 0: ignored; 1: it would show up as a new file


def test_summary_and_verdict_hand_values() -> None:
    Result = longtail_report.Result
    results = [Result("a", s, m, v) for s, v in ((0, 80.0), (1, 90.0))
               for m in longtail_report.CLASS_METRICS]
    results += [Result("b", s, m, 70.0) for s in (0, 1) for m in longtail_report.CLASS_METRICS]
    summary = longtail_report.summarize(results)
    mean, std = summary["a"]["overall"]
    assert mean == 85.0 and std == pytest.approx(math.sqrt(50.0))  # n - 1 = 1 denominator
    assert summary["b"]["few"] == (70.0, 0.0)
    text = longtail_report.verdict(summary)
    assert "overall: a 85.0 %, ahead of b 70.0 % by 15.0 points;" in text
    assert "| a | 85.0 ± 7.1 | 85.0 ± 7.1 |" in longtail_report.markdown_table(summary)
