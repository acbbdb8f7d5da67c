"""The benchmark harness: percentiles, interleaved order, timing arithmetic, memory.

Fake methods and a fake clock make every expected value exact; nothing here depends on how fast
the machine is (no wall-clock assertions).
"""

from __future__ import annotations

import pytest
import torch

from memfine.bench.harness import Method, interleaved_order, percentiles, run_methods
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
