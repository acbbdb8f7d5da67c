"""The benchmark harness: percentiles, interleaved order, timing arithmetic, memory.

Fake methods and a fake clock make every expected value exact; nothing here depends on how fast
the machine is (no wall-clock assertions).
"""

from __future__ import annotations

import time

import pytest
import torch

from memfine.bench import harness
from memfine.bench.harness import (
    GIVEN,
    THREAD_CPU,
    WALL,
    Method,
    MethodResult,
    cpu_clock,
    interleaved_order,
    percentiles,
    round_ratios,
    run_methods,
)
from memfine.measure.report import MemoryReport


class FakeClock:
    """A clock that advances by a fixed step on every read (seconds)."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def recording_method(name: str, log: list[str], **kwargs: object) -> Method:
    """A method that appends its name to ``log`` on every forward."""
    def forward() -> str:
        log.append(name)
        return name

    return Method(name=name, forward=forward, backward=lambda out: None, **kwargs)  # type: ignore[arg-type]


def test_percentiles_hand_values() -> None:
    # Sorted [10..60], 6 samples: positions 0.2·5 = 1, 0.5·5 = 2.5, 0.8·5 = 4 (linear method).
    assert percentiles([60, 10, 50, 20, 40, 30]) == (20.0, 35.0, 50.0)
    assert percentiles([7.0]) == (7.0, 7.0, 7.0)
    assert percentiles([1, 3], qs=(0.0, 0.5, 1.0)) == (1.0, 2.0, 3.0)


@pytest.mark.parametrize("values, qs", [([], (0.5,)), ([1.0], (1.5,))], ids=["empty", "q_above_1"])
def test_percentiles_rejects(values: list[float], qs: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="percentiles needs|quantile must be in"):
        percentiles(values, qs)


def test_interleaved_order_rotates() -> None:
    names = ["a", "b", "c"]
    assert [interleaved_order(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert interleaved_order([], 3) == []


def test_run_methods_call_order() -> None:
    """Warm-up rounds interleaved, two memory calls each, then timed rounds interleaved."""
    log: list[str] = []
    methods = [recording_method(n, log) for n in "abc"]
    results = run_methods(methods, repeats=3, warmup=2, clock=FakeClock(1.0))
    assert log == (["a", "b", "c", "b", "c", "a"]  # warm-up rounds 0, 1
                   + ["a", "b", "c"]  # memory: live tracker
                   + ["a", "b", "c"]  # memory: torch.profiler (CPU)
                   + ["a", "b", "c", "b", "c", "a", "c", "a", "b"])  # timed rounds 0, 1, 2
    assert all(r.extras["profiler_peak_bytes"] == (r.peak_bytes, "bytes") for r in results)


def test_run_methods_times_from_clock() -> None:
    """Each call reads the clock 3 times: forward and backward take one step each."""
    log: list[str] = []
    zeroed: list[str] = []
    method = recording_method("a", log, tokens=500, zero_grad=lambda: zeroed.append("a"))
    (res,) = run_methods([method], repeats=4, warmup=1, measure=False, clock=FakeClock(0.25))
    assert res.times_s == {"fwd": [0.25] * 4, "bwd": [0.25] * 4, "full": [0.5] * 4}
    assert res.time_ms("full") == (500.0, 500.0, 500.0)
    assert res.tokens_per_s() == (1000.0, 1000.0, 1000.0)
    assert res.memory is None and res.saved_bytes is None
    assert len(zeroed) == len(log) == 5  # zero_grad before every call


def test_run_methods_memory_and_prediction() -> None:
    """exp saves its (T, d) fp32 output; backward adds dx: peak 2·T·d·4 bytes, exactly."""
    x = torch.randn(64, 32, requires_grad=True)
    grad = torch.randn(64, 32)
    nbytes = x.numel() * 4

    def zero() -> None:
        x.grad = None

    method = Method(name="exp", forward=lambda: x.exp(), backward=lambda y: y.backward(grad),
                    zero_grad=zero, tokens=64,
                    predict=lambda: {"saved_bytes": nbytes, "peak_bytes": None},
                    extras=lambda: {"dtype_bytes": (x.element_size(), "bytes")})
    (res,) = run_methods([method], repeats=2, warmup=1)
    assert isinstance(res.memory, MemoryReport)
    assert (res.saved_bytes, res.peak_bytes) == (nbytes, 2 * nbytes)
    assert res.predicted == {"saved_bytes": nbytes, "peak_bytes": None}
    assert res.extras == {"dtype_bytes": (4, "bytes"),
                          "profiler_peak_bytes": (2 * nbytes, "bytes")}  # same as the tracker
    assert len(res.times_s["full"]) == 2


def test_run_methods_records_a_failing_method() -> None:
    log: list[str] = []

    def broken() -> None:
        raise RuntimeError("strides should be multiple of 16 bytes")

    methods = [recording_method("ok", log),
               Method(name="bad", forward=broken, backward=lambda out: None)]
    ok, bad = run_methods(methods, repeats=2, warmup=1, clock=FakeClock(1.0))
    assert bad.error == "RuntimeError: strides should be multiple of 16 bytes"
    assert bad.time_ms() is None and bad.memory is None
    assert ok.error is None and len(ok.times_s["full"]) == 2
    assert log == ["ok"] * 5  # warm-up, memory (tracker, profiler), 2 timed


@pytest.mark.parametrize("kwargs, match", [
    ({"repeats": 0}, "repeats must be >= 1"),
    ({"repeats": 1, "warmup": -1}, "warmup >= 0"),
], ids=["repeats_0", "warmup_negative"])
def test_run_methods_validates(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_methods([recording_method("a", [])], **kwargs)


def test_run_methods_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="method names must be unique"):
        run_methods([recording_method("a", []), recording_method("a", [])], repeats=1)


def test_a_compiled_method_is_measured_by_the_profiler_alone() -> None:
    """exp under torch.compile (aot_eager): Dynamo does not compile under the tracker's dispatch
    mode, so the one memory call runs under torch.profiler; exp saves its (T, d) fp32 output
    and backward adds dx, as in eager: peak 2·T·d·4 bytes."""
    x = torch.randn(64, 32, requires_grad=True)
    grad = torch.randn(64, 32)
    nbytes = x.numel() * 4
    exp = torch.compile(lambda: x.exp(), backend="aot_eager", fullgraph=True)
    calls: list[int] = []

    def forward() -> torch.Tensor:
        calls.append(1)
        return exp()

    def zero() -> None:
        x.grad = None

    method = Method(name="exp_compiled", forward=forward, backward=lambda y: y.backward(grad),
                    zero_grad=zero, peak="profiler")
    (res,) = run_methods([method], repeats=2, warmup=1)
    assert res.error is None
    assert len(calls) == 4  # warm-up (compiles), one memory call, two timed
    assert (res.saved_bytes, res.peak_bytes) == (nbytes, 2 * nbytes)
    assert res.extras == {"profiler_peak_bytes": (2 * nbytes, "bytes")}
    torch.testing.assert_close(x.grad, grad * x.detach().exp())


def test_method_rejects_an_unknown_peak_measurement() -> None:
    with pytest.raises(ValueError, match=r"Method.peak must be one of \('tracker', 'profiler'\), "
                                         r"got 'live' \(method 'a'\)"):
        Method(name="a", forward=lambda: None, backward=lambda out: None, peak="live")


class ManualClock:
    """A clock that moves only when a fake method spends time (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def costly_method(name: str, clock: ManualClock, costs: list[float]) -> Method:
    """A method whose n-th call spends ``costs[n]`` s: a quarter forward, the rest backward."""
    calls: list[int] = []

    def forward() -> None:
        clock.now += costs[len(calls)] / 4
        calls.append(1)

    def backward(out: None) -> None:
        clock.now += 3 * costs[len(calls) - 1] / 4

    return Method(name=name, forward=forward, backward=backward)


@pytest.mark.parametrize("threads, name, clock", [
    (1, THREAD_CPU, time.thread_time), (2, WALL, time.perf_counter),
    (16, WALL, time.perf_counter)], ids=["one_thread", "two_threads", "sixteen_threads"])
def test_cpu_clock_is_thread_time_at_one_thread_only(threads: int, name: str, clock: object,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_clock(threads) == (name, clock)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert cpu_clock() == (name, clock)


@pytest.mark.parametrize("threads, patched, name", [(1, "thread_time", THREAD_CPU),
                                                    (2, "perf_counter", WALL)],
                         ids=["one_thread", "two_threads"])
def test_run_methods_times_with_the_clock_of_its_threads(threads: int, patched: str, name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a clock, the run reads cpu_clock's at torch's threads and names it per method."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(harness.time, patched, FakeClock(0.5))

    def broken() -> None:
        raise RuntimeError("no kernel")

    ok, bad = run_methods([recording_method("a", []),
                           Method(name="bad", forward=broken, backward=lambda out: None)],
                          repeats=2, warmup=0, measure=False)
    assert ok.clock == name and ok.times_s["full"] == [1.0, 1.0]
    assert (bad.clock, bad.error) == ("", "RuntimeError: no kernel")  # never timed


def test_run_methods_names_a_given_clock() -> None:
    (fake,) = run_methods([recording_method("a", [])], repeats=1, warmup=0, measure=False,
                          clock=FakeClock(1.0))
    (thread,) = run_methods([recording_method("a", [])], repeats=1, warmup=0, measure=False,
                            clock=time.thread_time)
    assert (fake.clock, thread.clock) == (GIVEN, THREAD_CPU)


def test_round_ratios_are_per_round_not_a_ratio_of_medians() -> None:
    """Rounds interleave (a, ref), (ref, a), ...; each round's ratio is a's time ÷ ref's."""
    clock = ManualClock()
    ref_s = [1.0, 2.0, 4.0, 1.0, 1.0]
    a_s = [2.0, 2.0, 2.0, 3.0, 1.0]  # per round: 2, 1, 0.5, 3, 1 → median 1
    a, ref = run_methods([costly_method("a", clock, a_s), costly_method("ref", clock, ref_s)],
                         repeats=5, warmup=0, measure=False, clock=clock)
    assert a.times_s["full"] == a_s and ref.times_s["full"] == ref_s
    assert a.times_s["fwd"] == [0.5, 0.5, 0.5, 0.75, 0.25]
    p20, p50, p80 = round_ratios(a, ref)
    assert p50 == 1.0  # the ratio of the medians would be 2 ÷ 1 = 2
    assert (p20, p80) == pytest.approx((0.9, 2.2), rel=1e-12)  # sorted 0.5 1 1 2 3
    assert round_ratios(a, ref, "fwd") == round_ratios(a, ref, "full")  # the same quarter
    assert round_ratios(ref, ref) == (1.0, 1.0, 1.0)


def test_round_ratios_use_the_rounds_both_methods_ran() -> None:
    """A method that raised in round 2 has 2 times: only rounds 0 and 1 are compared."""
    res, ref = MethodResult(name="a"), MethodResult(name="ref")
    res.times_s["full"] = [3.0, 6.0]
    ref.times_s["full"] = [1.0, 2.0, 100.0, 100.0]
    assert round_ratios(res, ref) == (3.0, 3.0, 3.0)
    assert round_ratios(ref, res) == pytest.approx((1 / 3,) * 3, rel=1e-15)
    ref.times_s["full"] = [0.0, 2.0]  # a zero reference time has no ratio
    assert round_ratios(res, ref) == (3.0, 3.0, 3.0)
    assert round_ratios(res, MethodResult(name="never_timed")) is None
    assert round_ratios(MethodResult(name="never_timed"), ref) is None
