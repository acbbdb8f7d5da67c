"""``memfine bench`` says what wins: one verdict line per suite from its points, a note where a
point reverses it, unique table headers, a legend for the counts tables, integer axes on
``chunks.png`` and help text without reST markup."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memfine.bench.harness import MethodResult
from memfine.bench.options import Point
from memfine.bench.output import HEADERS
from memfine.bench.verdicts import COUNTS_LEGEND, verdict_lines
from memfine.cli.main import SUBCOMMANDS, build_parser
from memfine.measure import MemoryReport
from memfine.units import MiB


def _result(name: str, peak_mib: float, times: list[float], saved_mib: float = 0.1
            ) -> MethodResult:
    return MethodResult(name=name, tokens=64, times_s={"fwd": [], "bwd": [], "full": times},
                        memory=MemoryReport(saved_bytes=int(saved_mib * MiB),
                                            peak_bytes=int(peak_mib * MiB)))


def _point(x: str, results: list[MethodResult]) -> Point:
    return Point(suite="experts", x_name="table1_conf", x_value=x, label=x, config={},
                 results=results, reference="fused")


def test_verdict_names_the_lowest_peers_peak_and_the_time_against_it() -> None:
    # conf1: the lowest peer is grouped_mm (2.0 MiB); fused 1.0 MiB; times fused/grouped_mm per
    # round 0.5, 1.0, 0.8 → median 0.8. conf2: fused 3.0 against plain's 4.0, 0.9 each round.
    conf1 = _point("conf1", [_result("fused", 1.0, [0.5, 1.0, 0.8]),
                             _result("plain", 4.0, [2.0, 2.0, 2.0]),
                             _result("grouped_mm", 2.0, [1.0, 1.0, 1.0]),
                             _result("fused_mact", 0.5, [9.0, 9.0, 9.0])])  # not a peer
    conf2 = _point("conf2", [_result("fused", 3.0, [0.9, 0.9, 0.9]),
                             _result("plain", 4.0, [1.0, 1.0, 1.0])])
    lines = verdict_lines("experts", [conf1, conf2])
    assert lines[0].startswith("verdict experts: fused: 0.50–0.75× the lowest peer's peak at "
                               "0.80–0.90× its time (median of per-round ratios, ")
    assert lines[0].endswith("; 2 points, peers plain, expert_loop, grouped_mm, torchtitan")
    assert len(lines) == 1  # no point reverses it


def test_a_point_where_the_subject_peaks_above_a_peer_gets_a_note() -> None:
    quick = _point("quick", [_result("fused", 0.69, [1.0], saved_mib=0.15),
                             _result("plain", 0.65, [1.0], saved_mib=0.34)])
    lines = verdict_lines("experts", [quick])
    assert lines[0].startswith("verdict experts: fused: 1.06× the lowest peer's peak at 1.00×")
    assert "fused's peak 0.69 MiB is above plain's 0.65 MiB" in lines[1]
    assert "weight gradients" in lines[1] and "22% of its peak" in lines[1] and "dH" in lines[1]


def test_a_suite_without_a_verdict_or_without_results_prints_nothing() -> None:
    assert verdict_lines("experts", []) == []
    assert verdict_lines("unknown", [_point("x", [_result("fused", 1.0, [1.0])])]) == []


def test_table_headers_are_unique_and_counts_have_a_legend() -> None:
    assert len(set(HEADERS)) == len(HEADERS)
    assert verdict_lines("counts", []) == [f"legend: {COUNTS_LEGEND}"]
    for column in ("ops fwd", "÷ ref", "syncs", "gmm", "fast", "sync kinds"):
        assert column in COUNTS_LEGEND


def test_chunks_figure_has_integer_ticks() -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from memfine.reports.metrics import chunks_figure

    chunks_LS = torch.tensor([[1, 2, 2, 4, 8], [1, 1, 2, 2, 2]], dtype=torch.float64)
    fig = chunks_figure(plt, [10, 20, 30, 40, 50], chunks_LS)
    fig.canvas.draw()
    ax, bar = fig.axes
    for ticks in (ax.get_xticks(), ax.get_yticks(), bar.get_yticks()):
        assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_has_no_rest_markup(command: str | None, capsys: pytest.CaptureFixture[str]
                                 ) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"] if command is None else [command, "--help"])
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":class:", ":mod:", ":data:", ":meth:"):
        assert markup not in text, (command, markup)


class _Counted:
    """A counts-suite result: ``phase("full")`` gives its ops, syncs and grouped_mm calls."""

    def __init__(self, name: str, ops: int, syncs: int, fast: int, calls: int) -> None:
        self.name, self.error = name, None
        self._full = SimpleNamespace(non_view_ops=ops, host_syncs=syncs, grouped_mm=[
            SimpleNamespace(fast_path=i < fast) for i in range(calls)])

    def phase(self, mode: str) -> SimpleNamespace:
        assert mode == "full"
        return self._full


def test_counts_verdict_is_one_line_over_the_presets() -> None:
    points = [Point(suite="counts", x_name="preset", x_value=name, label=name, config={},
                    results=[_Counted("fused", ops, 1, 6, 6),
                             _Counted("torchtitan_style", 100, 0, 6, 6)],
                    reference="torchtitan_style")
              for name, ops in (("qwen3-30b-a3b", 136), ("deepseek-v3", 170))]
    lines = verdict_lines("counts", points)
    assert lines == [f"legend: {COUNTS_LEGEND}",
                     "verdict counts: fused: 1.36–1.70× torchtitan_style's ops, 1 host sync "
                     "against 0, 6 of 6 grouped_mm calls on CUDA's fast path; 2 points"]
