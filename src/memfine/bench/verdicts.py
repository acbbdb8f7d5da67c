"""What wins in a ``memfine bench`` suite: one verdict line, and a note where a point reverses it.

The verdict compares the suite's memfine method (the subject) with its peers, the layers people
use today: at each point the peer with the lowest peak, the subject's peak ÷ that peer's, and the
median over the timed rounds of the subject's time ÷ that peer's in the same round
(:func:`memfine.bench.harness.round_ratios`). Peaks are ``torch.profiler``'s where measured (the
CPU ground truth), else the live tracker's. Over several points the line gives the range. A point
where the subject peaks above the lowest peer gets a note saying why (:data:`VERDICTS`).
The counts suite has its own line: the subject's ops against the torchtitan-style layer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memfine.bench.harness import MethodResult, round_ratios
from memfine.bench.options import Point
from memfine.bench.output import clock_text
from memfine.units import MiB

_SMALL_SHAPE = ("at this small shape the peak is mostly the weight gradients every method "
                "allocates (what {subject} saves for backward is {share:.0%} of its peak), and "
                "{subject}'s backward keeps its saved H alive next to the row block's dH, where "
                "{peer}'s autograd has freed its saved copies by its peak; the saving grows "
                "with the tokens (docs/results.md, \"Peak memory when activations dominate\")")
VERDICTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "experts": ("fused", ("plain", "expert_loop", "grouped_mm", "torchtitan"), _SMALL_SHAPE),
    "model": ("fused", ("plain",), _SMALL_SHAPE),
    "hf": ("memfine", ("hf_eager", "hf_grouped_mm"), _SMALL_SHAPE),
    "chunking": ("mact", ("full_recompute", "fixed_c8"),
                 "MACT runs the fewest chunks whose predicted peak fits its budget, so below the "
                 "worst skew it runs fewer, faster chunks than {peer} and peaks higher, within "
                 "the budget"),
}
"""Suite → (subject, peers, why the subject may peak above the lowest peer at a point)."""
COUNTS_LEGEND = ("ops fwd, ops bwd: non-view ATen ops of the forward and the backward (about one "
                 "kernel launch each on a GPU); ÷ ref: forward + backward ops ÷ the reference's; "
                 "syncs: host syncs in forward + backward (by kind under 'sync kinds'); gmm: "
                 "torch._grouped_mm calls; fast: those CUDA's CUTLASS kernel takes")


def _peak(res: MethodResult) -> int | None:
    profiled = res.extras.get("profiler_peak_bytes", (None, ""))[0]
    return profiled if isinstance(profiled, int) else res.peak_bytes


def _span(values: Sequence[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}×" if low == high else f"{low}–{high}×"


def verdict_lines(suite: str, points: Sequence[Point]) -> list[str]:
    """The suite's verdict line and its notes (none for a suite without a verdict)."""
    if suite == "counts":
        return _counts_lines(points)
    if suite not in VERDICTS:
        return []
    subject, peers, why = VERDICTS[suite]
    peaks: list[float] = []
    times: list[float] = []
    notes: list[str] = []
    for point in points:
        by_name = {r.name: r for r in point.results if r.error is None}
        own = by_name.get(subject)
        rivals = [(peak, r) for name, r in by_name.items()
                  if name in peers and (peak := _peak(r))]
        own_peak = None if own is None else _peak(own)
        if own is None or not own_peak or not rivals:
            continue
        low, peer = min(rivals, key=lambda pr: pr[0])
        peaks.append(own_peak / low)
        ratio = round_ratios(own, peer)
        if ratio is not None:
            times.append(ratio[1])
        if own_peak > low:
            share = (own.saved_bytes or 0) / own_peak
            reason = (why.format(subject=subject, peer=peer.name, share=share) if not notes
                      else "as above")
            notes.append(f"  note: at {point.x_name} {point.x_value} {subject}'s peak "
                         f"{own_peak / MiB:.2f} MiB is above {peer.name}'s {low / MiB:.2f} MiB: "
                         + reason)
    if not peaks:
        return []
    clock = clock_text([r for p in points for r in p.results])
    at = f" at {_span(times)} its time (median of per-round ratios, {clock})" if times else ""
    return [f"verdict {suite}: {subject}: {_span(peaks)} the lowest peer's peak{at}; "
            f"{len(peaks)} point{'s' if len(peaks) > 1 else ''}, peers {', '.join(peers)}",
            *notes]


def _counts_lines(points: Sequence[Point]) -> list[str]:
    """The legend, then ``fused: 1.36× torchtitan_style's ops, 1 host sync against 0, ...``."""
    ratios, syncs, ref_syncs, fast, calls = [], [], [], [], []
    for point in points:
        by_name: dict[str, Any] = {r.name: r for r in point.results if r.error is None}
        own, ref = by_name.get("fused"), by_name.get(point.reference)
        if own is None or ref is None:
            continue
        full, ref_full = own.phase("full"), ref.phase("full")
        ratios.append(full.non_view_ops / ref_full.non_view_ops)
        syncs.append(full.host_syncs)
        ref_syncs.append(ref_full.host_syncs)
        fast.append(sum(g.fast_path for g in full.grouped_mm))
        calls.append(len(full.grouped_mm))
    lines = [f"legend: {COUNTS_LEGEND}"]
    if ratios:
        lines.append(f"verdict counts: fused: {_span(ratios)} {points[0].reference}'s ops, "
                     f"{_ints(syncs)} host sync{'' if max(syncs) == 1 else 's'} against "
                     f"{_ints(ref_syncs)}, {_ints(fast)} of "
                     f"{_ints(calls)} grouped_mm calls on CUDA's fast path; {len(ratios)} "
                     f"point{'s' if len(ratios) > 1 else ''}")
    return lines


def _ints(values: Sequence[int]) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}–{max(values)}"
