"""Results of the long-tail example: per-seed CSV, mean ± std table, verdict, bar chart, README.

A :class:`Result` is one test accuracy in percent of one model and seed; its ``metric`` is
``overall`` or a group name (``many``, ``medium``, ``few``: accuracy on the test images whose true
class is in that group).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

CLASS_METRICS = ("overall", "many", "medium", "few")
README_BEGIN = "<!-- BEGIN results: written by run.py, do not edit by hand -->"
README_END = "<!-- END results -->"

Summary = dict[str, dict[str, tuple[float, float]]]


@dataclass(frozen=True, slots=True)
class Result:
    """One test accuracy: ``value_pct`` percent for ``model`` on ``metric`` with ``seed``."""

    model: str
    seed: int
    metric: str
    value_pct: float


def summarize(results: list[Result]) -> Summary:
    """Mean and sample standard deviation (n − 1; 0 for one seed) per model and metric, percent.

    Returns:
        ``{model: {metric: (mean, std)}}`` with models in first-seen order.
    """
    values: dict[str, dict[str, list[float]]] = {}
    for r in results:
        values.setdefault(r.model, {}).setdefault(r.metric, []).append(r.value_pct)
    return {model: {metric: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
                    for metric, v in metrics.items()}
            for model, metrics in values.items()}


def markdown_table(summary: Summary) -> str:
    """Markdown table: one row per model, columns overall/many/medium/few as ``mean ± std``."""
    lines = ["| model | " + " | ".join(CLASS_METRICS) + " |",
             "|---|" + "---|" * len(CLASS_METRICS)]
    for model, metrics in summary.items():
        cells = [f"{metrics[m][0]:.1f} ± {metrics[m][1]:.1f}" for m in CLASS_METRICS]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(summary: Summary) -> str:
    """One sentence per column saying which model has the best mean and by how much."""
    sentences = []
    for metric in CLASS_METRICS:
        ranked = sorted(summary, key=lambda model: summary[model][metric][0], reverse=True)
        (best_mean, best_std), (next_mean, next_std) = (summary[ranked[0]][metric],
                                                         summary[ranked[1]][metric])
        gap = round(best_mean, 1) - round(next_mean, 1)  # as the table shows them
        if gap == 0:
            sentences.append(f"{metric}: {ranked[0]} and {ranked[1]} tie at {best_mean:.1f} %")
            continue
        within = " (within one standard deviation)" if gap <= max(best_std, next_std) else ""
        sentences.append(f"{metric}: {ranked[0]} {best_mean:.1f} %, ahead of {ranked[1]} "
                         f"{next_mean:.1f} % by {gap:.1f} points{within}")
    return "Best mean per column — " + "; ".join(sentences) + "."


def write_csv(results: list[Result], path: Path, meta: dict[str, str]) -> None:
    """Write one line per result, with ``meta`` (versions, timestamp) on every line."""
    fields = ["model", "seed", "metric", "value_pct", *meta]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in results:
            writer.writerow({**asdict(r), "value_pct": f"{r.value_pct:.4f}", **meta})


def plot(summary: Summary, path: Path, title: str) -> None:
    """Grouped bar chart of mean test accuracy per metric, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.8 / len(summary)
    for i, (model, metrics) in enumerate(summary.items()):
        xs = [j + (i - (len(summary) - 1) / 2) * width for j in range(len(CLASS_METRICS))]
        ax.bar(xs, [metrics[m][0] for m in CLASS_METRICS], width,
               yerr=[metrics[m][1] for m in CLASS_METRICS], capsize=3, label=model)
    ax.set_xticks(range(len(CLASS_METRICS)), CLASS_METRICS)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_readme_section(path: Path, body: str) -> None:
    """Replace the text between the README's results markers with ``body``.

    Raises:
        ValueError: if ``path`` lacks either marker (nothing is written then).
    """
    text = path.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{path} must contain the lines {README_BEGIN!r} and {README_END!r} "
                         f"(in that order) around the results section")
    path.write_text(text[:start + len(README_BEGIN)] + "\n" + body.strip() + "\n" + text[end:])
