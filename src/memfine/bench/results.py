"""Benchmark results as CSV rows: the docs/style.md §6 schema and the environment a run had.

:func:`result_rows` (a point of :func:`memfine.bench.harness.run_methods`) and :func:`csv_row` (a
metric a script measures itself) write rows of :data:`CSV_COLUMNS` with the
:class:`memfine.environment.Environment` (re-exported with
:func:`collect_environment`); a value not measured reads
``"not measured"``, a missing prediction ``"not modelled"``, never 0 or -1.

Units: times in milliseconds; bytes are ints; throughput in tokens/s.
Reference: docs/style.md §6 (benchmarks) and §7 (predicted next to measured).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memfine.bench.harness import MODES, MethodResult, Value, round_ratios
from memfine.bench.options import Point
from memfine.environment import Environment
from memfine.environment import collect_environment as collect_environment
from memfine.units import NOT_MEASURED

NOT_MODELLED = "not modelled"
CSV_COLUMNS = ("benchmark", "method", "mode", "metric", "unit", "x_name", "x_value", "p20",
               "p50", "p80", "device", "cpu_model", "threads", "torch_version", "triton_version",
               "memfine_version", "git_sha", "utc_timestamp", "config_json")


def format_value(value: Value, *, missing: str = NOT_MEASURED) -> str:
    """CSV text of a value: ints exactly, floats with 6 significant digits, ``None`` as missing."""
    if value is None:
        return missing
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"value must be an int, a float or None, got {value!r}")
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _ratio(num: int | None, den: int | None) -> float | None:
    return None if num is None or not den else num / den


def _metrics(res: MethodResult, ref: MethodResult | None
             ) -> list[tuple[str, str, str, tuple[Value, ...] | Value]]:
    """(metric, mode, unit, values) of one result; values a (p20, p50, p80) or one value."""
    rows: list[tuple[str, str, str, tuple[Value, ...] | Value]] = [
        ("time", mode, "ms", res.time_ms(mode)) for mode in MODES]
    if ref is not None:
        rows += [(f"time_ratio_to_{ref.name}", mode, "ratio", round_ratios(res, ref, mode))
                 for mode in MODES]
    rows.append(("tokens_per_s", "full", "tokens/s", res.tokens_per_s()))
    for item, mode in (("saved_bytes", "fwd"), ("peak_bytes", "full")):
        measured = getattr(res, item)
        predicted = res.predicted.get(item)
        rows += [(item, mode, "bytes", measured),
                 (f"{item}_predicted", mode, "bytes", predicted),
                 (f"{item}_predicted_over_measured", mode, "ratio", _ratio(predicted, measured))]
    rows += [(name, "full", unit, value) for name, (value, unit) in res.extras.items()]
    return rows


def csv_row(*, benchmark: str, method: str, mode: str, metric: str, unit: str, x_name: str,
            x_value: object, values: Sequence[Value] | Value, config: Mapping[str, Any],
            env: Environment, missing: str = NOT_MEASURED) -> dict[str, str]:
    """One CSV row (:data:`CSV_COLUMNS`, in order) of one method, metric and point.

    Args:
        benchmark: suite or script name (e.g. ``experts``).
        method: the method's name.
        mode: ``fwd``, ``bwd`` or ``full``.
        metric: metric name (e.g. ``time``, ``peak_bytes``).
        unit: the metric's unit (``ms``, ``bytes``, ``ratio``, ...).
        x_name: what varies across points.
        x_value: this point's value (written with ``str``).
        values: (p20, p50, p80), or one value written in all three.
        config: the point's configuration, written as JSON (keys sorted).
        env: from :func:`collect_environment`.
        missing: the text of a ``None`` value.
    """
    triple = tuple(values) if isinstance(values, Sequence) else (values,) * 3
    p20, p50, p80 = (format_value(v, missing=missing) for v in triple)
    row = {"benchmark": benchmark, "method": method, "mode": mode, "metric": metric,
           "unit": unit, "x_name": x_name, "x_value": str(x_value), "p20": p20, "p50": p50,
           "p80": p80, "device": env.device, "cpu_model": env.cpu_model,
           "threads": str(env.threads), "torch_version": env.torch_version,
           "triton_version": env.triton_version, "memfine_version": env.memfine_version,
           "git_sha": env.git_sha, "utc_timestamp": env.utc_timestamp,
           "config_json": json.dumps(dict(config), sort_keys=True, default=str)}
    return {column: row[column] for column in CSV_COLUMNS}


def result_rows(results: Iterable[MethodResult], *, benchmark: str, x_name: str, x_value: object,
                config: Mapping[str, Any], env: Environment, reference: str | None = None
                ) -> list[dict[str, str]]:
    """CSV rows (:data:`CSV_COLUMNS`) of one benchmark point, one row per method and metric.

    Metrics: ``time`` (ms; modes fwd, bwd, full), with a reference
    ``time_ratio_to_<reference>`` (ratio; modes fwd, bwd, full: p20/p50/p80 over the rounds of
    the method's time ÷ the reference's in the same round,
    :func:`memfine.bench.harness.round_ratios`), ``tokens_per_s`` (tokens/s), ``saved_bytes``
    and ``peak_bytes`` (bytes), each with ``*_predicted`` (bytes) and
    ``*_predicted_over_measured`` (ratio), then the method's extras. A single value fills p20,
    p50 and p80. Missing values read ``not measured``; missing predictions ``not modelled``.
    A timed method's rows carry its clock in ``config_json`` (``clock``: a key of
    :data:`memfine.bench.harness.CLOCKS`) and the number of its timed rounds (``rounds``).

    Args:
        results: from :func:`run_methods`.
        benchmark: suite name (e.g. ``experts``).
        x_name: what varies across points (e.g. ``table1_conf``, ``skew``).
        x_value: this point's value.
        config: the point's configuration (shapes, dtype, budget, ...), written as JSON.
        env: from :func:`collect_environment`.
        reference: the method the time ratios are taken against; ``None`` (or a method not in
            ``results``) writes no ratio rows.
    """
    results = list(results)
    ref = next((r for r in results if r.name == reference), None)
    rows = []
    for res in results:
        clocked = ({**config, "clock": res.clock, "rounds": len(res.times_s["full"])}
                   if res.clock else config)
        for metric, mode, unit, values in _metrics(res, ref):
            rows.append(csv_row(benchmark=benchmark, method=res.name, mode=mode,
                                metric=metric, unit=unit, x_name=x_name, x_value=x_value,
                                values=values, config=clocked, env=env,
                                missing=NOT_MODELLED if "_predicted" in metric else NOT_MEASURED))
    return rows


def point_rows(point: Point, env: Environment, *, failed: bool = True) -> list[dict[str, str]]:
    """CSV rows of one :class:`Point` (:func:`result_rows`), with the machine's load recorded.

    ``config_json`` is the point's config plus ``load_average_1min`` (the machine's 1-minute
    load average now, as the point finishes) and each timed method's ``clock`` and ``rounds``;
    the time ratios
    are taken against ``point.reference`` (``time_ratio_to_<reference>`` rows).

    Args:
        point: the point (its suite is the CSV's ``benchmark``).
        env: from :func:`collect_environment`.
        failed: write the rows of methods that raised (their values read ``not measured``);
            ``False`` leaves them out.
    """
    config = {**point.config, "load_average_1min": round(os.getloadavg()[0], 2)}
    results = [r for r in point.results if failed or r.error is None]
    return result_rows(results, benchmark=point.suite, x_name=point.x_name,
                       x_value=point.x_value, config=config, env=env, reference=point.reference)


def write_csv(rows: Iterable[Mapping[str, str]], path: str | Path,
              columns: Sequence[str] = CSV_COLUMNS) -> Path:
    """Write rows under the ``columns`` header (parent folders are created).

    Args:
        rows: from :func:`result_rows` or :func:`csv_row` (with any extra ``columns`` added).
        path: the CSV file.
        columns: the header: :data:`CSV_COLUMNS`, plus a script's own trailing columns.

    Returns:
        The path written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return out


def write_run_config(options: Mapping[str, Any], env: Environment, out: str | Path) -> Path:
    """Write ``bench_config.json`` in ``out`` (created): a run's resolved options and environment.

    Args:
        options: the run's options as plain values (``BenchOptions.to_dict()``).
        env: where the run ran.
        out: the output folder; an earlier run's file there is replaced.

    Returns:
        The path written.
    """
    path = Path(out) / "bench_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    resolved = {"options": dict(options), "environment": dataclasses.asdict(env)}
    path.write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
    return path
