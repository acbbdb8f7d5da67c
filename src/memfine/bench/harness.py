"""Benchmark harness shared by ``memfine bench`` and ``benchmarks/``: time and memory of methods.

A *method* (:class:`Method`) is a named pair of callables, ``forward() -> out`` and
``backward(out)``, plus a ``zero_grad()`` run before every call (gradients set to ``None``, so
each call creates its gradients as a training step does). :func:`run_methods` runs them in one
process: warm-up rounds; one memory call per method
(:func:`memfine.measure.report.measure_memory`, plus a ``torch.profiler`` call on the CPU);
then timed rounds, each call timed as forward (mode ``fwd``), backward (``bwd``) and the whole
(``full``), with CUDA events on a GPU and, on the CPU, the clock :func:`cpu_clock` picks:
the calling thread's CPU time (``time.thread_time``) at one torch intra-op thread, which other
processes on a shared machine do not inflate, else the wall clock. Every round calls the methods
in *interleaved order* (round r starts at method r mod M), so a load change on a shared machine
hits every method alike, and :func:`round_ratios` compares methods round by round. A method that
raises is recorded with its error and dropped. Predictions (``predict()``, typically
:mod:`memfine.memory.layer`) are read after the calls, so they may depend on run-time decisions
such as MACT's chunk count.

Units: seconds inside the harness (milliseconds from :meth:`MethodResult.time_ms`); bytes are
ints; throughput in tokens/s. The harness takes callables and imports no other memfine layer.
Reference: docs/style.md §6 (benchmarks) and §7 (predicted next to measured).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memfine.measure.report import PEAK_METHODS, MemoryReport, measure_memory

MODES = ("fwd", "bwd", "full")
QUANTILES = (0.2, 0.5, 0.8)
# Errors a method may raise that the harness records instead of stopping the run (alignment
# rules of torch._grouped_mm, out-of-memory, a backend missing on this device).
METHOD_ERRORS = (RuntimeError, ValueError, NotImplementedError, ImportError)

THREAD_CPU = "thread_cpu"
WALL = "wall"
CUDA_EVENTS = "cuda_events"
GIVEN = "given"
CLOCKS: dict[str, str] = {
    THREAD_CPU: "thread CPU time (time.thread_time)",
    WALL: "wall clock (time.perf_counter)",
    CUDA_EVENTS: "CUDA events",
    GIVEN: "a clock given to run_methods",
}
"""Clock name (:attr:`MethodResult.clock`, the CSV's ``config_json`` ``clock``) → description."""
_KNOWN: dict[Callable[[], float], str] = {time.thread_time: THREAD_CPU, time.perf_counter: WALL}

Value = int | float | None
Extra = tuple[Value, str]
"""An extra metric of a method: ``(value, unit)``; ``None`` when not measured."""


def _nothing() -> None:
    return None


def _no_tensors() -> Iterable[torch.Tensor]:
    return ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Method:
    """One way of doing the benchmarked work (a "method" in the CSV).

    Attributes:
        name: method name, unique within a run (e.g. ``fused``, ``grouped_mm``).
        forward: runs the forward pass; returns what ``backward`` needs (e.g. the output).
        backward: runs the backward pass (and an optimizer step, for training steps).
        zero_grad: called before every call; must set the gradients it owns to ``None``.
        tokens: tokens processed per call (for tokens/s); 0 leaves tokens/s not measured.
        exclude: tensors whose storages the saved-bytes count leaves out (parameters are always
            left out), e.g. the module's buffers.
        predict: the model's prediction after the calls: ``{"saved_bytes": int | None,
            "peak_bytes": int | None}``; ``None`` when the memory model does not cover the method.
        extras: further metrics after the calls: ``{metric: (value, unit)}``.
        peak: how the memory call measures peak bytes off CUDA: ``tracker`` (the live-storage
            tracker, then one more call under ``torch.profiler``) or ``profiler`` (one call under
            ``torch.profiler`` only). Compiled callables need ``profiler``: inductor allocates
            outside the dispatcher, where the tracker does not see it, and Dynamo does not
            compile under the tracker's ``TorchDispatchMode``. Saved bytes come from
            saved-tensor hooks either way.
    """

    name: str
    forward: Callable[[], Any]
    backward: Callable[[Any], None]
    zero_grad: Callable[[], None] = _nothing
    tokens: int = 0
    exclude: Callable[[], Iterable[torch.Tensor]] = _no_tensors
    predict: Callable[[], Mapping[str, int | None]] | None = None
    extras: Callable[[], Mapping[str, Extra]] | None = None
    peak: str = "tracker"

    def __post_init__(self) -> None:
        """Check ``peak``.

        Raises:
            ValueError: when ``peak`` is not one of :data:`PEAK_METHODS`.
        """
        if self.peak not in PEAK_METHODS:
            raise ValueError(f"Method.peak must be one of {PEAK_METHODS}, got {self.peak!r} "
                             f"(method {self.name!r})")


@dataclass(kw_only=True, slots=True)
class MethodResult:
    """What :func:`run_methods` measured for one method.

    Attributes:
        name: the method's name.
        tokens: tokens per call.
        times_s: mode (``fwd``, ``bwd``, ``full``) → seconds of each timed call, in order.
        memory: the memory report of the measured call; ``None`` when not measured.
        predicted: ``saved_bytes``/``peak_bytes`` → predicted bytes (``None``: not modelled).
        extras: metric → (value, unit).
        error: ``"<Type>: <message>"`` when the method raised (it was then dropped).
        clock: the name of the clock that timed the calls (a key of :data:`CLOCKS`); "" when
            no call was timed.
    """

    name: str
    tokens: int = 0
    times_s: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    memory: MemoryReport | None = None
    predicted: dict[str, int | None] = field(
        default_factory=lambda: {"saved_bytes": None, "peak_bytes": None})
    extras: dict[str, Extra] = field(default_factory=dict)
    error: str | None = None
    clock: str = ""

    def time_ms(self, mode: str = "full") -> tuple[float, float, float] | None:
        """(p20, p50, p80) of ``mode`` in milliseconds; ``None`` when not measured."""
        return _p20_p50_p80([1e3 * v for v in self.times_s.get(mode, [])])

    def tokens_per_s(self) -> tuple[float, float, float] | None:
        """(p20, p50, p80) of tokens/s over the ``full`` calls; ``None`` when not measured."""
        return _p20_p50_p80([self.tokens / t for t in self.times_s["full"] if t > 0]
                            if self.tokens else [])

    @property
    def saved_bytes(self) -> int | None:
        """Measured saved-for-backward bytes (``None``: not measured)."""
        return None if self.memory is None else self.memory.saved_bytes

    @property
    def peak_bytes(self) -> int | None:
        """Measured peak live bytes of forward + backward (``None``: not measured)."""
        return None if self.memory is None else self.memory.peak_bytes


def percentiles(values: Sequence[float], qs: Sequence[float] = QUANTILES) -> tuple[float, ...]:
    """Quantiles by linear interpolation between closest ranks (numpy's default method).

    Args:
        values: samples (any order), at least one.
        qs: quantiles in [0, 1].

    Returns:
        One value per quantile; with one sample, that sample for every quantile.

    Raises:
        ValueError: on no samples or a quantile outside [0, 1].
    """
    if not values:
        raise ValueError("percentiles needs at least one value, got none")
    ordered = sorted(float(v) for v in values)
    out = []
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return tuple(out)


def _p20_p50_p80(values: Sequence[float]) -> tuple[float, float, float] | None:
    if not values:
        return None
    p20, p50, p80 = percentiles(values)
    return p20, p50, p80


def round_ratios(result: MethodResult, reference: MethodResult, mode: str = "full"
                 ) -> tuple[float, float, float] | None:
    """(p20, p50, p80) over the timed rounds of ``result``'s time ÷ ``reference``'s time.

    Each round's ratio divides the two methods' times of that round, so a load change that hits
    one round hits both of its times; the quantiles are taken over these per-round ratios (not a
    ratio of the two medians). Rounds line up by index: a method that raises stops recording, so
    each list of times is a prefix of the rounds, and only the rounds both methods ran count. A
    round whose reference time is 0 has no ratio and is left out.

    Args:
        result: the method compared.
        reference: the baseline (``result`` itself gives 1 in every round).
        mode: ``fwd``, ``bwd`` or ``full``.

    Returns:
        The quantiles (:data:`QUANTILES`), or ``None`` when no round has both times.
    """
    pairs = zip(result.times_s.get(mode, []), reference.times_s.get(mode, []), strict=False)
    return _p20_p50_p80([t / base for t, base in pairs if base > 0])


def cpu_clock(threads: int | None = None) -> tuple[str, Callable[[], float]]:
    """The clock of CPU timings at ``threads`` torch intra-op threads: ``(name, clock)``.

    One thread: the calling thread's CPU time (:data:`THREAD_CPU`, ``time.thread_time``), which
    other processes on a shared machine do not inflate. More threads: the wall clock
    (:data:`WALL`, ``time.perf_counter``), named as such: thread CPU time counts the calling
    thread only and would leave out the intra-op workers' share of the work (a share that
    differs per method), and process CPU time would count the workers' spin-waiting and hide
    any parallel speed-up.

    Args:
        threads: the intra-op threads; ``None`` reads ``torch.get_num_threads()``.
    """
    threads = torch.get_num_threads() if threads is None else threads
    return (THREAD_CPU, time.thread_time) if threads == 1 else (WALL, time.perf_counter)


def interleaved_order(names: Sequence[str], round_index: int) -> list[str]:
    """The call order of round ``round_index``: start at ``round_index mod M``, wrap around."""
    if not names:
        return []
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


class _Stopwatch:
    """Time marks on one device: CUDA events on a GPU, else a clock in seconds."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None) -> None:
        self.cuda = device.type == "cuda" and clock is None
        self.device = device
        self.name, self.clock = cpu_clock() if clock is None else (_KNOWN.get(clock, GIVEN), clock)
        if self.cuda:
            self.name = CUDA_EVENTS

    def start(self) -> Any:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return self.mark()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """Seconds between consecutive marks (synchronises once on a GPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
        return [float(b - a) for a, b in zip(marks, marks[1:], strict=False)]


def _timed_call(method: Method, watch: _Stopwatch) -> tuple[float, float]:
    """One zero_grad + forward + backward; returns (forward, backward) seconds."""
    method.zero_grad()
    t0 = watch.start()
    out = method.forward()
    t1 = watch.mark()
    method.backward(out)
    t2 = watch.mark()
    del out
    fwd_s, bwd_s = watch.seconds([t0, t1, t2])
    return fwd_s, bwd_s


def _measure_call(method: Method, device: torch.device, peak: str = "tracker") -> MemoryReport:
    """One call under the saved-bytes tracker and the ``peak`` measurement."""
    method.zero_grad()
    with measure_memory(device, exclude=list(method.exclude()), peak=peak) as m:
        out = method.forward()
        m.end_forward()
        method.backward(out)
        del out
    return m.report()


class _Run:
    """The state of one :func:`run_methods` call: results, and the methods still live."""

    def __init__(self, methods: Sequence[Method], device: torch.device,
                 clock: Callable[[], float] | None) -> None:
        self.by_name = {m.name: m for m in methods}
        self.results = {m.name: MethodResult(name=m.name, tokens=m.tokens) for m in methods}
        self.live = [m.name for m in methods]
        self.device = device
        self.watch = _Stopwatch(device, clock)

    def attempt(self, name: str, fn: Callable[[Method], Any]) -> Any:
        """``fn(method)``; a method that raises is recorded and dropped (returns ``None``)."""
        try:
            return fn(self.by_name[name])
        except METHOD_ERRORS as err:
            self.results[name].error = f"{type(err).__name__}: {err}"
            self.live.remove(name)
            return None

    def rounds(self, count: int, record: bool) -> None:
        """``count`` rounds of timed calls in interleaved order; ``record`` keeps the times."""
        for r in range(count):
            for name in interleaved_order(self.live, r):
                fwd_bwd = self.attempt(name, lambda m: _timed_call(m, self.watch))
                if record and fwd_bwd is not None:
                    self.results[name].clock = self.watch.name
                    times = self.results[name].times_s
                    times["fwd"].append(fwd_bwd[0])
                    times["bwd"].append(fwd_bwd[1])
                    times["full"].append(fwd_bwd[0] + fwd_bwd[1])

    def measure(self) -> None:
        """Memory calls: each method's ``peak`` measurement, then (CPU) the profiler's pass."""
        cuda = self.device.type == "cuda"
        peaks = {name: "tracker" if cuda else self.by_name[name].peak for name in self.live}
        for name in list(self.live):
            self.results[name].memory = self.attempt(
                name, lambda m: _measure_call(m, self.device, peaks[m.name]))
        for name in [] if cuda else list(self.live):  # CPU ground truth: the profiler's peak
            report = self.results[name].memory
            if peaks[name] == "tracker":
                report = self.attempt(name, lambda m: _measure_call(m, self.device, "profiler"))
            if report is not None:
                self.results[name].extras["profiler_peak_bytes"] = (report.peak_bytes, "bytes")

    def finish(self) -> None:
        """Read each live method's predictions and extras after its calls."""
        for name in self.live:
            method, res = self.by_name[name], self.results[name]
            if method.predict is not None:
                res.predicted.update(method.predict())
            if method.extras is not None:
                res.extras.update(method.extras())


def run_methods(methods: Sequence[Method], *, repeats: int, warmup: int = 1,
                device: str | torch.device = "cpu", measure: bool = True,
                clock: Callable[[], float] | None = None) -> list[MethodResult]:
    """Warm up, measure memory and time every method, interleaved, in this process.

    Args:
        methods: the methods, names unique.
        repeats: timed rounds (≥ 1).
        warmup: untimed rounds first (≥ 0).
        device: device of the work; ``cuda`` devices are timed with CUDA events and measured
            with the allocator statistics; CPU work with :func:`cpu_clock` at torch's current
            intra-op threads (thread CPU time at one thread, else the wall clock).
        measure: run the memory measurement calls (off CUDA: one per method under its
            :attr:`Method.peak` measurement, plus one under ``torch.profiler`` for a
            ``tracker`` method; the profiler's peak is the extra ``profiler_peak_bytes``).
        clock: a clock in seconds replacing :func:`cpu_clock`'s (and CUDA events), recorded
            under its name in :data:`CLOCKS` (``time.thread_time``, ``time.perf_counter``),
            else as :data:`GIVEN`; for tests and scripts that fix their clock.

    Returns:
        One :class:`MethodResult` per method, in the order given.

    Raises:
        ValueError: on repeats < 1, warmup < 0 or duplicate names.

    Side effects: runs the methods (their parameters' gradients and optimizer state change).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    run = _Run(methods, torch.device(device), clock)
    run.rounds(warmup, record=False)
    if measure:
        run.measure()
    run.rounds(repeats, record=True)
    run.finish()
    return [run.results[name] for name in names]
