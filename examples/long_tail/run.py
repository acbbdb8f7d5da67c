"""Long-tailed digits: softmax vs logit adjustment vs the mutual exclusive modulator.

scikit-learn's bundled 8×8 digits are made long-tailed (imbalance ratio 50, exponential profile,
balanced test split; see ``longtail_data.py``), and three classifiers are trained per seed on the
same split: a plain softmax MLP, the same MLP with post-hoc logit adjustment (Menon et al. 2021),
and the mutual exclusive modulator (three group heads mixed by memfine's router; see
``modulator.py``). Two more rows read the same trained modulator differently: routed to its
top-1 group, and with the logit adjustment applied to its class log-probabilities. The script
prints mean ± std over the seeds of overall, many, medium and
few-shot test accuracy, and writes ``results.csv``, ``summary.json`` and ``accuracy.png`` to
``--out`` (default ``runs/long_tail``, git-ignored) and, with ``--readme``, the results section
of that README. The committed results are rewritten only when asked for:

    pip install -e '.[examples]'          # scikit-learn, matplotlib
    python examples/long_tail/run.py      # 5 seeds, into runs/long_tail/
    python examples/long_tail/run.py --seeds 1 --epochs 20 --out /tmp/lt
    python examples/long_tail/run.py --out examples/long_tail/results \
        --readme examples/long_tail/README.md     # the committed results and README section
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from memfine.flags.values import finite_float, int_at_least

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longtail_data import GROUP_NAMES, LongTailSplit, load_digits_tensors, make_split  # noqa: E402
from longtail_report import (  # noqa: E402
    Result,
    markdown_table,
    plot,
    replace_readme_section,
    summarize,
    verdict,
    write_csv,
)
from modulator import (  # noqa: E402
    ModulatorClassifier,
    SoftmaxClassifier,
    TrainConfig,
    accuracy_by_group,
    logit_adjusted,
    train_model,
)

MODELS = ("softmax", "logit adjustment", "modulator", "modulator, top-1 group",
          "modulator + logit adjustment")
GROUP_ROUTING = "modulator group prediction"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """How the long-tailed split is drawn (see ``longtail_data.make_split``)."""

    imbalance_ratio: float = 50.0
    test_per_class: int = 60
    many_min: int = 40
    few_below: int = 10


@dataclass(frozen=True, slots=True)
class SeedRun:
    """One seed's split, trained modulator and results."""

    split: LongTailSplit
    modulator: ModulatorClassifier
    results: list[Result]


def run_seed(seed: int, x_NP: torch.Tensor, y_N: torch.Tensor, data: DataConfig,
             train: TrainConfig, tau: float) -> SeedRun:
    """Draw the split for ``seed``, train the softmax MLP and the modulator, evaluate all models."""
    split = make_split(x_NP, y_N, seed=seed, **asdict(data))
    num_pixels = x_NP.shape[1]
    torch.manual_seed(seed)
    softmax = SoftmaxClassifier(num_pixels, split.num_classes, train.hidden_size)
    train_model(softmax, softmax.loss, split.x_train_NP, split.y_train_N, train, seed=seed)
    torch.manual_seed(seed)
    modulator = ModulatorClassifier(split.groups, num_pixels, train.hidden_size)
    train_model(modulator, modulator.loss, split.x_train_NP, split.y_train_N, train, seed=seed)
    with torch.no_grad():
        logits_NC = softmax(split.x_test_NP)
        out = modulator(split.x_test_NP)
    predictions = {
        "softmax": logits_NC.argmax(-1),
        "logit adjustment": logit_adjusted(logits_NC, split.class_prior_C, tau).argmax(-1),
        "modulator": out.class_log_probs_BC.argmax(-1),
        "modulator, top-1 group": modulator.predict_top1(out),
        "modulator + logit adjustment": logit_adjusted(out.class_log_probs_BC,
                                                       split.class_prior_C, tau).argmax(-1),
    }
    results = [Result(model, seed, metric, value)
               for model, pred_N in predictions.items()
               for metric, value in accuracy_by_group(pred_N, split.y_test_N,
                                                      split.group_of_class_C,
                                                      GROUP_NAMES).items()]
    # the modulator's group prediction, scored as a 3-class problem (G groups, identity mapping)
    group_acc = accuracy_by_group(out.group_probs_BG.argmax(-1),
                                  split.group_of_class_C[split.y_test_N],
                                  torch.arange(len(GROUP_NAMES)), GROUP_NAMES)
    results += [Result(GROUP_ROUTING, seed, metric, value) for metric, value in group_acc.items()]
    return SeedRun(split=split, modulator=modulator, results=results)


def _number_from(low: float, *, open_low: bool = False) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number (memfine's ``finite_float``) ≥ ``low`` (> if open)."""
    sign = ">" if open_low else ">="

    def parse(text: str) -> float:
        number = finite_float(text)
        if number < low or (open_low and number == low):
            raise argparse.ArgumentTypeError(f"expected a number {sign} {low:g}, got {text!r}")
        return number

    return parse


_COUNT = int_at_least(1)


def _parser() -> argparse.ArgumentParser:
    """The flags, with their defaults (which reproduce the committed results) in --help."""
    t, d = TrainConfig(), DataConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = " (default: %(default)s)"
    p.add_argument("--seeds", type=_COUNT, default=5,
                   help="number of seeds, run as 0..N-1" + default)
    p.add_argument("--epochs", type=_COUNT, default=t.epochs,
                   help="passes over the training split" + default)
    p.add_argument("--batch-size", type=_COUNT, default=t.batch_size,
                   help="images per optimiser step" + default)
    p.add_argument("--lr", type=_number_from(0.0, open_low=True), default=t.lr,
                   help="AdamW learning rate, > 0" + default)
    p.add_argument("--hidden-size", type=_COUNT, default=t.hidden_size,
                   help="width of the MLP's hidden layer" + default)
    p.add_argument("--imbalance-ratio", type=_number_from(1.0), default=d.imbalance_ratio,
                   help="largest / smallest training class, >= 1" + default)
    p.add_argument("--test-per-class", type=_COUNT, default=d.test_per_class,
                   help="test images per class (balanced test split)" + default)
    p.add_argument("--many-min", type=_COUNT, default=d.many_min,
                   help="classes with at least this many training images are 'many'" + default)
    p.add_argument("--few-below", type=_COUNT, default=d.few_below,
                   help="classes with fewer training images are 'few'; <= --many-min" + default)
    p.add_argument("--tau", type=_number_from(0.0), default=1.0,
                   help="logit adjustment τ, >= 0" + default)
    p.add_argument("--threads", type=_COUNT, default=1, help="torch intra-op threads" + default)
    p.add_argument("--out", type=Path, default=Path("runs/long_tail"),
                   help="folder for results.csv, summary.json, accuracy.png (default: "
                        "%(default)s, git-ignored; examples/long_tail/results is the "
                        "committed one)")
    p.add_argument("--readme", default="",
                   help="README whose results section is rewritten (examples/long_tail/"
                        "README.md for the committed results); default: none")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; defaults reproduce the committed results.

    Raises:
        SystemExit: (status 2, one line naming the flag and what it allows) on a bad value.
    """
    p = _parser()
    args = p.parse_args(argv)
    if args.few_below > args.many_min:
        p.error(f"--few-below must be <= --many-min ({args.many_min}), got {args.few_below}")
    return args


def describe(split: LongTailSplit, data: DataConfig) -> str:
    """Training counts and groups, as printed and written to the README."""
    counts = ", ".join(str(n) for n in split.train_counts_C.tolist())
    groups = "; ".join(f"{name} = classes {list(classes)}, "
                       f"{int(split.train_counts_C[list(classes)].sum())} training images"
                       for name, classes in zip(GROUP_NAMES, split.groups, strict=True))
    return (f"Training images per class 0–9: {counts} ({int(split.train_counts_C.sum())} in "
            f"all; imbalance ratio {data.imbalance_ratio:g}). Groups: {groups} (many: ≥ "
            f"{data.many_min} training images, few: < {data.few_below}). Test: "
            f"{data.test_per_class} images per class.")


def main(argv: list[str] | None = None) -> list[SeedRun]:
    """Run every seed, print the table, write the results files; return the seed runs."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = DataConfig(imbalance_ratio=args.imbalance_ratio, test_per_class=args.test_per_class,
                      many_min=args.many_min, few_below=args.few_below)
    train = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                        hidden_size=args.hidden_size)
    x_NP, y_N = load_digits_tensors()
    try:  # the limits that depend on the digits' class sizes
        make_split(x_NP, y_N, seed=0, **asdict(data))
    except ValueError as err:
        _parser().error(str(err).replace("test_per_class", "--test-per-class"))
    start = time.perf_counter()
    runs = []
    for seed in range(args.seeds):
        runs.append(run_seed(seed, x_NP, y_N, data, train, args.tau))
        accs = {r.model: r.value_pct for r in runs[-1].results
                if r.metric == "overall" and r.model in MODELS}
        print(f"seed {seed}: overall " + ", ".join(f"{m} {a:.1f} %" for m, a in accs.items()),
              flush=True)
    wall_s = time.perf_counter() - start
    write_outputs(runs, args, data, train, wall_s)
    return runs


def _figure_link(args: argparse.Namespace) -> str:
    """accuracy.png as the README links it: relative to ``--readme`` (or to ``--out``)."""
    figure = (args.out / "accuracy.png").resolve()
    base = Path(args.readme).resolve().parent if args.readme else args.out.resolve()
    return Path(os.path.relpath(figure, base)).as_posix()


def write_outputs(runs: list[SeedRun], args: argparse.Namespace, data: DataConfig,
                  train: TrainConfig, wall_s: float) -> None:
    """Print the table and write results.csv, summary.json, accuracy.png and the README section."""
    import sklearn

    results = [r for run in runs for r in run.results]
    summary = summarize(results)
    class_summary = {model: summary[model] for model in MODELS}
    split = runs[0].split
    largest_test_group = 100.0 * max(len(classes) for classes in split.groups) / split.num_classes
    meta = {"torch": torch.__version__, "sklearn": sklearn.__version__,
            "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    threads = f"{args.threads} torch thread{'s' if args.threads > 1 else ''}"
    conditions = (f"`python examples/long_tail/run.py` with {args.seeds} seeds "
                  f"(0–{args.seeds - 1}), {train.epochs} epochs, batch {train.batch_size}, AdamW "
                  f"lr {train.lr:g}, weight decay {train.weight_decay:g}, hidden width "
                  f"{train.hidden_size}, τ = {args.tau:g}, {threads}, "
                  f"torch {meta['torch']}, scikit-learn {meta['sklearn']}, "
                  f"{meta['utc']}, {wall_s:.0f} s of training and evaluation.")
    routing = (f"The modulator's group prediction (argmax of P(g | x)) on the same test images, "
               f"% correct, overall and by true group (predicting the largest test group every "
               f"time scores {largest_test_group:.1f} % overall):")
    body = "\n\n".join([conditions, describe(split, data),
                        "Test accuracy (%), mean ± std over seeds:",
                        markdown_table(class_summary), verdict(class_summary), routing,
                        markdown_table({GROUP_ROUTING: summary[GROUP_ROUTING]}),
                        f"![test accuracy per group]({_figure_link(args)})"])
    print("\n" + body)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(results, args.out / "results.csv", meta)
    (args.out / "summary.json").write_text(json.dumps(
        {"config": {"data": asdict(data), "train": asdict(train), "tau": args.tau,
                    "seeds": args.seeds, "threads": args.threads},
         "meta": meta, "wall_s": wall_s,
         "summary_pct": {m: {k: {"mean": v[0], "std": v[1]} for k, v in metrics.items()}
                         for m, metrics in summary.items()}}, indent=2) + "\n")
    plot(class_summary, args.out / "accuracy.png",
         f"long-tailed digits (imbalance {data.imbalance_ratio:g}), mean ± std over "
         f"{args.seeds} seed{'s' if args.seeds > 1 else ''}")
    if args.readme:
        replace_readme_section(Path(args.readme), body)
        print(f"wrote {args.readme}")
    print(f"wrote {args.out}/results.csv, summary.json, accuracy.png")


if __name__ == "__main__":
    main()
