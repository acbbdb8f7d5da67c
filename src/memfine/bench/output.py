"""Terminal tables and PNG plots of ``memfine bench`` results.

Tables use rich when it is installed (``memfine[train]``/``[dev]``), else plain aligned text.
Plots use matplotlib with the Agg backend, imported lazily; without matplotlib they are skipped
with a message. Units: times in ms, memory in MiB (2^20 bytes), throughput in tokens/s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfine._optional import is_available, pyplot
from memfine.bench.harness import CLOCKS, MethodResult, round_ratios
from memfine.bench.options import Point
from memfine.bench.results import NOT_MODELLED
from memfine.units import NOT_MEASURED, MiB

HEADERS = ("method", "fwd+bwd ms", "p20-p80 ms", "÷ ref", "tokens/s", "saved MiB",
           "model saved MiB", "peak MiB", "profiler MiB", "model peak MiB", "peak ÷ ref", "c")
"""The terminal table's columns; each header names one column."""


def _mib(value: int | None, missing: str = NOT_MEASURED) -> str:
    return missing if value is None else f"{value / MiB:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def table_rows(point: Point) -> list[tuple[str, ...]]:
    """One row of strings per method (:data:`HEADERS` order)."""
    by_name = {r.name: r for r in point.results}
    ref = by_name.get(point.reference)
    ref_peak = ref.peak_bytes if ref is not None else None
    rows = []
    for res in point.results:
        if res.error is not None:
            rows.append((res.name, f"failed: {res.error}"[:60], *("",) * (len(HEADERS) - 2)))
            continue
        t = res.time_ms()
        tps = res.tokens_per_s()
        chunks = res.extras.get("num_chunks", (None, ""))[0]
        profiled = res.extras.get("profiler_peak_bytes", (None, ""))[0]
        per_round = round_ratios(res, ref) if ref is not None else None
        rows.append((
            res.name,
            NOT_MEASURED if t is None else f"{t[1]:.1f}",
            "" if t is None else f"{t[0]:.1f}-{t[2]:.1f}",
            "-" if per_round is None else f"{per_round[1]:.2f}",
            NOT_MEASURED if tps is None else f"{tps[1]:.0f}",
            _mib(res.saved_bytes), _mib(res.predicted.get("saved_bytes"), NOT_MODELLED),
            _mib(res.peak_bytes), _mib(profiled if isinstance(profiled, int) else None),
            _mib(res.predicted.get("peak_bytes"), NOT_MODELLED),
            _ratio(res.peak_bytes, ref_peak),
            "-" if chunks is None else str(chunks),
        ))
    return rows


def format_plain(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table with a title line; no line ends in spaces."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def print_point(point: Point) -> None:
    """Print one point's title line, its table (rich when installed) and its reference line.

    No line ends in spaces, on a terminal or a pipe (rich pads a table's title to the table's
    width: the title is printed as a line of its own).
    """
    rows = table_rows(point)
    title = f"[{point.suite}] {point.label}"
    if importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        print(title, flush=True)
        table = Table()
        for i, h in enumerate(HEADERS):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            table.add_row(*(escape(c) for c in r))
        Console(width=160).print(table)
    else:
        print(format_plain(title, HEADERS, rows))
    print(f"fwd+bwd: p50 over repeats, timed with {clock_text(point.results)}; ÷ ref: median "
          f"over rounds of the time ÷ '{point.reference}''s in the same round; peak: live tracker "
          "(*_compiled: torch.profiler); profiler: torch.profiler's allocator events; model "
          "saved / peak MiB: the memory model's prediction; c: chunks")


def clock_text(results: Sequence[MethodResult]) -> str:
    """The clock(s) that timed ``results``, described (:data:`CLOCKS`); "no clock" if none."""
    names = list(dict.fromkeys(r.clock for r in results if r.clock))
    return ", ".join(CLOCKS.get(n, n) for n in names) or "no clock"


def _save(plt: Any, fig: Any, title: str, path: Path) -> Path:
    """Title, lay out, write and close a figure; return its path."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _methods(points: Sequence[Point]) -> list[str]:
    return list(dict.fromkeys(r.name for p in points for r in p.results))


def _result(point: Point, name: str) -> MethodResult | None:
    return next((r for r in point.results if r.name == name), None)


def _bars(ax: Any, points: Sequence[Point], names: list[str], value: Any, *,
          predicted: Any = None, errors: Any = None) -> None:
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, ys, lo, hi, px, py = [], [], [], [], [], []
        for j, p in enumerate(points):
            res = _result(p, name)
            v = value(res) if res is not None else None
            x = j + (i - (len(names) - 1) / 2) * width
            if v is not None:
                xs.append(x)
                ys.append(v)
                if errors is not None:
                    e = errors(res)
                    lo.append(v - e[0])
                    hi.append(e[1] - v)
            pv = predicted(res) if predicted is not None and res is not None else None
            if pv is not None:
                px.append(x)
                py.append(pv)
        yerr = [lo, hi] if errors is not None and xs else None
        ax.bar(xs, ys, width, label=name, color=f"C{i}", yerr=yerr, capsize=2)
        if px:
            ax.scatter(px, py, marker="_", s=300, color="black", zorder=3,
                       label="memory model" if i == 0 else None)
    ax.set_xticks(range(len(points)), [p.x_value for p in points])
    ax.set_xlabel(points[0].x_name)


def plot_time(plt: Any, points: Sequence[Point], path: Path) -> Path:
    """Bars of fwd+bwd p50 ms per method and point, p20-p80 whiskers."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = _methods(points)

    def p50(r: MethodResult) -> float | None:
        t = r.time_ms()
        return None if t is None else t[1]

    _bars(ax, points, names, p50, errors=lambda r: (r.time_ms()[0], r.time_ms()[2]))
    ax.set_ylabel("forward + backward, ms (p50; whiskers p20-p80)")
    ax.set_title(clock_text([r for p in points for r in p.results]), fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    return _save(plt, fig, f"memfine bench {points[0].suite}: time", path)


def plot_memory(plt: Any, points: Sequence[Point], path: Path) -> Path:
    """Bars of saved and peak MiB per method and point; the memory model as black ticks."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = _methods(points)
    for ax, item, label in ((axes[0], "saved_bytes", "saved for backward, MiB"),
                            (axes[1], "peak_bytes", "peak live bytes (fwd + bwd), MiB")):
        def measured(r: MethodResult, item: str = item) -> float | None:
            v = getattr(r, item)
            return None if v is None else v / MiB

        def predicted(r: MethodResult, item: str = item) -> float | None:
            v = r.predicted.get(item)
            return None if v is None else v / MiB

        _bars(ax, points, names, measured, predicted=predicted)
        ax.set_ylabel(label)
    axes[1].legend(fontsize=8, ncol=2)
    return _save(plt, fig, f"memfine bench {points[0].suite}: memory (measured bars, model ticks)",
                 path)


def plot_predicted(plt: Any, points: Sequence[Point], path: Path) -> Path | None:
    """Predicted vs measured MiB (saved: circles, peak: triangles) with the y = x line."""
    pairs: list[tuple[str, str, float, float]] = []
    for p in points:
        for r in p.results:
            for item in ("saved_bytes", "peak_bytes"):
                pred, meas = r.predicted.get(item), getattr(r, item)
                if pred is not None and meas is not None and pred > 0 and meas > 0:
                    pairs.append((r.name, item, meas / MiB, pred / MiB))
    if not pairs:
        return None
    fig, ax = plt.subplots(figsize=(6, 6))
    names = _methods(points)
    for name, item, meas, pred in pairs:
        ax.scatter(meas, pred, color=f"C{names.index(name)}",
                   marker="o" if item == "saved_bytes" else "^")
    for i, name in enumerate(names):
        if any(n == name for n, *_ in pairs):
            ax.scatter([], [], color=f"C{i}", label=name)
    lo = min(min(m, q) for *_, m, q in pairs) * 0.8
    hi = max(max(m, q) for *_, m, q in pairs) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured, MiB")
    ax.set_ylabel("memory model, MiB")
    ax.legend(fontsize=8, title="o saved, ^ peak", title_fontsize=8)
    return _save(plt, fig, f"memfine bench {points[0].suite}: predicted vs measured", path)


def plot_skew(plt: Any, points: Sequence[Point], path: Path) -> Path:
    """Peak MiB and fwd+bwd ms vs skew, one line per method, the MACT budget dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = _methods(points)
    skews = [float(p.x_value) for p in points]
    for i, name in enumerate(names):
        found = [_result(p, name) for p in points]
        peaks = [None if r is None else r.peak_bytes for r in found]
        times = [None if r is None or r.time_ms() is None else r.time_ms()[1]  # type: ignore[index]
                 for r in found]
        for ax, ys, scale in ((axes[0], peaks, 1 / MiB), (axes[1], times, 1.0)):
            xy = [(s, y * scale) for s, y in zip(skews, ys, strict=True) if y is not None]
            if xy:
                ax.plot(*zip(*xy, strict=True), marker="os^D"[i % 4], color=f"C{i}",
                        linestyle=("-", "--", ":", "-.")[i % 4], label=name)
    budget = points[0].config.get("budget_bytes")
    if budget:
        axes[0].axhline(budget / MiB, color="black", linestyle="--", label="MACT budget")
    axes[0].set_ylabel("peak live bytes, MiB")
    axes[1].set_ylabel("forward + backward p50, ms")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(skews, [p.x_value for p in points])
        ax.set_xlabel("received rows ÷ balanced share (skew)")
    axes[0].legend(fontsize=8)
    return _save(plt, fig, "memfine bench chunking: memory and time vs routing skew", path)


def plot_points(points: Sequence[Point], out_dir: Path, suite: str) -> list[Path]:
    """Write the suite's PNGs (``bench_<suite>_<kind>.png``); [] without matplotlib."""
    if not points:
        return []
    if not is_available("matplotlib"):
        print("plots skipped: matplotlib is not installed (pip install 'memfine[train]')")
        return []
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_time(plt, points, out_dir / f"bench_{suite}_time.png"),
             plot_memory(plt, points, out_dir / f"bench_{suite}_memory.png")]
    predicted = plot_predicted(plt, points, out_dir / f"bench_{suite}_predicted.png")
    if predicted is not None:
        paths.append(predicted)
    if points[0].x_name == "skew":
        paths.append(plot_skew(plt, points, out_dir / f"bench_{suite}_skew.png"))
    return paths
