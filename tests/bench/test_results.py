"""Benchmark CSV rows: the docs/style.md §6 schema, missing values as text, the environment columns.

Results are built by hand, so every expected value is exact (no wall-clock assertions).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from memfine.bench.harness import MODES, MethodResult
from memfine.bench.results import (
    CSV_COLUMNS,
    NOT_MODELLED,
    collect_environment,
    csv_row,
    format_value,
    result_rows,
    write_csv,
)
from memfine.measure.report import NOT_MEASURED, MemoryReport


def _result(**kwargs: object) -> MethodResult:
    res = MethodResult(name="fused", tokens=100, **kwargs)  # type: ignore[arg-type]
    for mode, seconds in zip(MODES, (0.01, 0.03, 0.04), strict=True):
        res.times_s[mode] = [seconds]
    return res


def _rows(res: MethodResult) -> dict[str, dict[str, str]]:
    env = collect_environment()
    rows = result_rows([res], benchmark="experts", x_name="shape", x_value="conf3",
                       config={"tokens": 256}, env=env)
    return {f"{r['metric']}/{r['mode']}": r for r in rows}


def test_rows_schema_and_values() -> None:
    memory = MemoryReport(saved_bytes=1000, peak_bytes=4000)
    res = _result(memory=memory, predicted={"saved_bytes": 1000, "peak_bytes": 4400},
                  extras={"num_chunks": (2, "chunks")})
    rows = _rows(res)
    assert all(tuple(r) == CSV_COLUMNS for r in rows.values())
    full = rows["time/full"]
    assert (full["unit"], full["p50"], full["method"]) == ("ms", "40", "fused")
    assert (full["x_name"], full["x_value"], full["config_json"]) == (
        "shape", "conf3", '{"tokens": 256}')
    assert rows["tokens_per_s/full"]["p50"] == "2500"
    assert [rows["saved_bytes/fwd"][p] for p in ("p20", "p50", "p80")] == ["1000"] * 3
    assert rows["peak_bytes_predicted/full"]["p50"] == "4400"
    assert rows["peak_bytes_predicted_over_measured/full"]["p50"] == "1.1"
    assert (rows["num_chunks/full"]["p50"], rows["num_chunks/full"]["unit"]) == ("2", "chunks")


def test_rows_show_missing_values_as_text() -> None:
    """None is 'not measured' (measured metrics) or 'not modelled' (predictions), never 0/-1."""
    rows = _rows(_result())
    assert rows["saved_bytes/fwd"]["p50"] == NOT_MEASURED == "not measured"
    assert rows["peak_bytes/full"]["p80"] == NOT_MEASURED
    assert rows["saved_bytes_predicted/fwd"]["p20"] == NOT_MODELLED == "not modelled"
    assert rows["saved_bytes_predicted_over_measured/fwd"]["p50"] == NOT_MODELLED
    no_tokens = MethodResult(name="x", tokens=0)
    assert _rows(no_tokens)["tokens_per_s/full"]["p50"] == NOT_MEASURED
    assert _rows(no_tokens)["time/fwd"]["p50"] == NOT_MEASURED


@pytest.mark.parametrize("value, text", [(17642200, "17642200"), (0.123456789, "0.123457"),
                                         (None, NOT_MEASURED)], ids=["int", "float", "none"])
def test_format_value(value: int | float | None, text: str) -> None:
    assert format_value(value) == text


def test_write_csv_header(tmp_path: Path) -> None:
    rows = list(_rows(_result()).values())
    path = write_csv(rows, tmp_path / "sub" / "bench.csv")
    with path.open() as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        assert len(list(reader)) == len(rows)



def test_csv_row_single_value_and_triple() -> None:
    env = collect_environment()
    one = csv_row(benchmark="ep_peak", method="mact", mode="full", metric="peak_bytes",
                  unit="bytes", x_name="skew", x_value=0.5, values=4096, config={"b": 1, "a": 2},
                  env=env)
    assert tuple(one) == CSV_COLUMNS
    assert [one[p] for p in ("p20", "p50", "p80")] == ["4096"] * 3
    assert (one["x_value"], one["config_json"]) == ("0.5", '{"a": 2, "b": 1}')
    assert (one["threads"], one["git_sha"]) == (str(env.threads), env.git_sha)
    triple = csv_row(benchmark="b", method="p", mode="fwd", metric="time", unit="ms",
                     x_name="x", x_value=1, values=(1.5, 2.0, None), config={}, env=env,
                     missing=NOT_MODELLED)
    assert [triple[p] for p in ("p20", "p50", "p80")] == ["1.5", "2", NOT_MODELLED]


def test_write_csv_extra_columns(tmp_path: Path) -> None:
    row = {**next(iter(_rows(_result()).values())), "rank": "0"}
    path = write_csv([row], tmp_path / "ep.csv", columns=(*CSV_COLUMNS, "rank"))
    with path.open() as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames or ()) == (*CSV_COLUMNS, "rank")
        assert [r["rank"] for r in reader] == ["0"]


def test_rows_time_ratios_to_the_reference_and_the_clock() -> None:
    """time_ratio_to_<reference>: per-round ratio quantiles per mode; clock, rounds in config."""
    ref = MethodResult(name="fused", clock="thread_cpu")
    res = MethodResult(name="grouped_mm", clock="thread_cpu")
    ref.times_s = {"fwd": [0.5, 1.0, 1.0], "bwd": [0.5, 3.0, 3.0], "full": [1.0, 4.0, 4.0]}
    res.times_s = {"fwd": [1.0, 1.0, 2.0], "bwd": [3.0, 1.0, 6.0], "full": [4.0, 2.0, 8.0]}
    rows = result_rows([res, ref], benchmark="experts", x_name="shape", x_value="conf3",
                       config={"tokens": 256}, env=collect_environment(), reference="fused")
    got = {(r["method"], r["metric"], r["mode"]): r for r in rows}
    # full per round: 4, 0.5, 2 → median 2, where the ratio of the medians is 4 ÷ 4 = 1
    full = got[("grouped_mm", "time_ratio_to_fused", "full")]
    assert (full["unit"], full["p20"], full["p50"], full["p80"]) == ("ratio", "1.1", "2", "3.2")
    fwd = got[("grouped_mm", "time_ratio_to_fused", "fwd")]  # per round 2, 1, 2
    assert (fwd["p20"], fwd["p50"], fwd["p80"]) == ("1.4", "2", "2")
    bwd = got[("grouped_mm", "time_ratio_to_fused", "bwd")]  # per round 6, 1/3, 2
    assert (bwd["p20"], bwd["p50"], bwd["p80"]) == ("1", "2", "4.4")
    assert [got[("fused", "time_ratio_to_fused", m)]["p50"] for m in MODES] == ["1"] * 3
    assert got[("grouped_mm", "time", "full")]["p50"] == "4000"  # ms, the median of 4, 2, 8 s
    assert all(json.loads(r["config_json"]) == {"clock": "thread_cpu", "rounds": 3, "tokens": 256}
               for r in rows)


def test_rows_without_a_reference_have_no_ratios() -> None:
    rows = list(_rows(_result()))
    assert not [key for key in rows if key.startswith("time_ratio")]
    env = collect_environment()
    missing_ref = result_rows([_result()], benchmark="experts", x_name="shape", x_value="c",
                              config={}, env=env, reference="grouped_mm")
    assert not [r for r in missing_ref if r["metric"].startswith("time_ratio")]
    untimed = result_rows([MethodResult(name="fused"), _result()], benchmark="experts",
                          x_name="shape", x_value="c", config={}, env=env, reference="fused")
    ratios = {r["mode"]: r["p50"] for r in untimed if r["metric"] == "time_ratio_to_fused"}
    assert ratios == dict.fromkeys(MODES, NOT_MEASURED)
