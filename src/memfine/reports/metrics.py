"""Training metrics: ``metrics.jsonl`` lines, expert-load statistics, plots, final summary.

Legend: L MoE layers, E experts.

Each logged step is one JSON object in ``DIR/metrics.jsonl`` with at least ``step``,
``train_loss`` (nats/byte), ``lr``, ``tokens_per_s``, ``load_balancing_loss``, ``z_loss``,
``num_chunks`` and ``recompute`` (one per layer: c and the recompute mode the step ran),
``tokens_per_expert`` (per layer, summed over the steps since the
previous line), ``expert_load_max_over_mean`` (per layer), on evaluation steps ``val_loss``,
and under a memory budget ``block_rows`` (per layer: the rows per fused row block the layer
ran, MACT's choice).
Every line is strict JSON: a non-finite number (NaN, ±inf) is written as ``null`` and the line
gets ``"nonfinite": true``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from memfine._optional import require

METRICS_NAME = "metrics.jsonl"
TRACKER_SCALARS = ("train_loss", "val_loss", "lr", "tokens_per_s", "load_balancing_loss",
                       "z_loss", "grad_norm", "peak_bytes")


def load_max_over_mean(tokens_per_expert_E: torch.Tensor) -> float:
    """Hottest expert's assignments over the mean per expert (1.0 = perfectly balanced).

    Args:
        tokens_per_expert_E: (E,) integer assignment counts.

    Returns:
        max/mean; 0.0 when no token was routed.
    """
    counts = tokens_per_expert_E.double()
    mean = counts.mean()
    return float(counts.max() / mean) if mean > 0 else 0.0


def format_expert_load(tokens_per_expert_LE: torch.Tensor) -> str:
    """One line per layer: tokens per expert and max/mean."""
    lines = []
    for i, counts_E in enumerate(tokens_per_expert_LE):
        lines.append(f"  layer {i}: tokens/expert {counts_E.tolist()}  "
                     f"max/mean {load_max_over_mean(counts_E):.2f}")
    return "\n".join(lines)


def nats_to_bits(nats: float) -> float:
    """Convert nats to bits (÷ ln 2)."""
    return nats / math.log(2)


class MetricsLog:
    """Append-only writer of ``metrics.jsonl`` (one flushed line per record), and a tracker.

    Args:
        path: the jsonl file.
        keep_until_step: on resume, lines with ``step`` above this are dropped first (they were
            logged after the checkpoint and will be logged again). ``None`` starts a new file.
        tracker: a :class:`memfine.reports.trackers.Tracker` (TensorBoard, trackio, wandb) that
            also gets each record's numbers of :data:`TRACKER_SCALARS` at its ``step`` (as
            measured: a non-finite number stays one), or None.
    """

    def __init__(self, path: str | os.PathLike[str], *, keep_until_step: int | None = None,
                 tracker: Any = None) -> None:
        """Create (or, on resume, trim) the file."""
        self.path = Path(path)
        self.tracker = tracker
        kept = []
        if keep_until_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_until_step]
        with self.path.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict[str, Any]) -> None:
        """Append one strict-JSON line (non-finite numbers as ``null``) and flush it."""
        clean, nonfinite = _finite_or_null(record)
        if nonfinite:
            clean["nonfinite"] = True
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean, allow_nan=False) + "\n")
        if self.tracker is not None:
            scalars = {key: record[key] for key in TRACKER_SCALARS
                       if isinstance(record.get(key), (int, float))}
            if scalars:
                self.tracker.log(scalars, record["step"])

    def close(self) -> None:
        """Close the tracker, if any (the jsonl file is closed after every line)."""
        if self.tracker is not None:
            self.tracker.close()


def _finite_or_null(value: Any) -> tuple[Any, bool]:
    """``value`` with every non-finite float replaced by None, and whether any was."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, True
    if isinstance(value, dict):
        pairs = {k: _finite_or_null(v) for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(bad for _, bad in pairs.values())
    if isinstance(value, (list, tuple)):
        items = [_finite_or_null(v) for v in value]
        return [v for v, _ in items], any(bad for _, bad in items)
    return value, False


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` (a truncated last line, from a killed run, is ignored)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def chunks_figure(plt: Any, steps: list[int], chunks_LS: torch.Tensor) -> Any:
    """The ``chunks.png`` figure: c per layer (rows) and step (columns), integer axes.

    Steps, layers and chunk counts are integers, so every axis and the colour bar tick at
    integers only (``MaxNLocator(integer=True)``).
    """
    MaxNLocator = require("matplotlib.ticker").MaxNLocator  # noqa: N806 (a class)
    fig, ax = plt.subplots(figsize=(8, 3))
    image = ax.imshow(chunks_LS.numpy(), aspect="auto", interpolation="nearest", origin="lower",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, chunks_LS.shape[0] - 0.5))
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title("MoE chunk count c per layer")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    bar = fig.colorbar(image, ax=ax, label="num_chunks")
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    fig.tight_layout()
    return fig


def plot_run(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``chunks.png`` (num_chunks heatmap, layer × step) and ``loss.png`` from the metrics.

    Returns:
        The written paths.

    Raises:
        ImportError: naming the ``train`` extra when matplotlib is missing.

    Reference: the chunks heatmap follows MemFine Fig. 5 (chunk count per layer over steps).
    """
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")
    out_dir = Path(out_dir)
    records = read_metrics(out_dir / METRICS_NAME)
    steps = [r["step"] for r in records]
    chunks_LS = torch.tensor([r["num_chunks"] for r in records], dtype=torch.float64).T

    fig = chunks_figure(plt, steps, chunks_LS)
    chunks_png = out_dir / "chunks.png"
    fig.savefig(chunks_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["train_loss"] for r in records], label="train")
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.legend()
    fig.tight_layout()
    loss_png = out_dir / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)
    return [chunks_png, loss_png]


def report_final(out_dir: str | os.PathLike[str], *, step: int, val_loss: float, unigram: float,
                 tokens_per_s: float, wall_s: float, sample: str, temperature: float) -> str:
    """Print the end-of-run numbers; write ``summary.json`` and ``sample.txt``.

    Args:
        out_dir: the run directory.
        step: completed steps.
        val_loss: final validation loss, nats/byte.
        unigram: byte-unigram entropy of the validation split, nats/byte (the baseline).
        tokens_per_s: training throughput, tokens/s.
        wall_s: run time, seconds.
        sample: generated text ("" when skipped).
        temperature: sampling temperature of ``sample``.

    Returns:
        The headline: the final validation loss and how it compares with the unigram baseline.
    """
    out_dir = Path(out_dir)
    below = percent_below_unigram(val_loss, unigram)
    summary = {"step": step, "final_val_loss_nats_per_byte": val_loss,
               "final_val_loss_bits_per_byte": nats_to_bits(val_loss),
               "unigram_entropy_nats_per_byte": unigram,
               "unigram_entropy_bits_per_byte": nats_to_bits(unigram),
               "percent_below_unigram": below, "tokens_per_s": tokens_per_s, "wall_s": wall_s}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out_dir / "sample.txt").write_text(sample, encoding="utf-8")
    if sample:
        print(f"sample (temperature {temperature}):\n{sample}\n")
    print(f"final validation loss: {val_loss:.4f} nats/byte = "
          f"{nats_to_bits(val_loss):.4f} bits/byte")
    print(f"unigram (byte-frequency) entropy of the validation split: {unigram:.4f} nats/byte = "
          f"{nats_to_bits(unigram):.4f} bits/byte")
    if below is None:
        relation = (f"the validation split is one byte repeated (unigram entropy 0): the loss "
                    f"is {val_loss:.4f} nats/byte above that baseline, and no percentage of 0 "
                    f"is given (summary.json: percent_below_unigram null)")
    else:
        relation = (f"validation loss is {below:.1f}% below the unigram baseline" if below >= 0
                    else f"validation loss is {-below:.1f}% above the unigram baseline")
    print(f"{relation}; {step} steps, {tokens_per_s:,.0f} tokens/s, {wall_s:.0f} s")
    compared = ("above the unigram baseline of 0 (one byte repeated)" if below is None
                else f"{abs(below):.1f}% {'below' if below >= 0 else 'above'} the unigram baseline")
    return (f"final validation loss {val_loss:.4f} nats/byte = {nats_to_bits(val_loss):.4f} "
            f"bits/byte, {compared}")


def percent_below_unigram(val_loss: float, unigram: float) -> float | None:
    """How far the validation loss is below the unigram entropy, in % of that entropy.

    Returns:
        ``100·(1 − val_loss/unigram)`` (negative: above), or None when ``unigram`` is 0 (a
        validation split of one repeated byte: no percentage of 0 means anything).
    """
    return 100.0 * (1.0 - val_loss / unigram) if unigram > 0 else None
