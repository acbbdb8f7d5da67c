"""Peak live tensor bytes of a region of code: storage tracker on CPU, allocator stats on CUDA.

On the CPU (and any non-CUDA device) a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
sees every ATen operator, including those the autograd engine runs in backward. Each storage that an
operator *creates* is recorded once, with a weak-reference finalizer that subtracts its bytes when
the storage is freed; views, in-place results and storages that existed before the region (inputs,
parameters, pre-existing ``.grad`` buffers) are never counted. The tracker keeps the running total
and its maximum. On CUDA it reads ``torch.cuda.max_memory_allocated`` after a reset.

What is counted: bytes of tensor storages created inside the region while they are alive. What is
not: the allocator's rounding and caching, kernel workspaces that never become tensors (e.g. BLAS
packing buffers), storages created outside the dispatcher (``torch.from_numpy``), and everything
alive before the region (reported as ``baseline_bytes`` on CUDA, ``None`` on the CPU). The CPU
tracker costs about 10% on large operators and up to 6× on tiny ones (docs/design.md §8).

What the CPU tracker changes: under any ``TorchDispatchMode`` every operator output gets a Python
object that holds a reference to its storage, so when two gradients of one tensor meet in the
autograd engine's input buffer, the engine sums them out of place instead of adding the second
into the first: the tracker then sees one more gradient-sized buffer than the program allocates
without it. ``torch.profiler``'s allocator events do not change the program
(:class:`memfine.measure.profiled.ProfiledPeakMemory`, the CPU ground truth); on memfine's MoE
layer, whose chunk loop accumulates the weight gradients itself, both give the same peak
(tests/measure/test_profiled.py).

Reference: docs/design.md §8 (measurement on CPU), docs/style.md §7.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    """The untyped storages of every plain tensor in a pytree (meta tensors excluded)."""
    leaves, _ = tree_flatten(tree)
    return [t.untyped_storage() for t in leaves
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]


class _LiveStorageMode(TorchDispatchMode):
    """Dispatch mode that keeps the running and peak bytes of storages created under it."""

    def __init__(self, on_alloc: Callable[[str, int], None] | None = None) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.num_storages = 0
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._on_alloc = on_alloc

    def _freed(self, key: int) -> Callable[[object], None]:
        def callback(_: object) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current_bytes -= entry[1]
        return callback

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] | None = None
        for storage in _storages(out):
            key, nbytes = storage._cdata, storage.nbytes()
            entry = self._live.get(key)
            if entry is not None:  # seen before: only a resize (out= variants) changes bytes
                if entry[1] != nbytes:
                    self.current_bytes += nbytes - entry[1]
                    self._live[key] = (entry[0], nbytes)
                continue
            if inputs is None:
                inputs = {s._cdata for s in _storages((args, kwargs))}
            if key in inputs:  # a view or in-place result of a storage from before the region
                continue
            self._live[key] = (weakref.ref(storage, self._freed(key)), nbytes)
            self.current_bytes += nbytes
            self.num_storages += 1
            if self._on_alloc is not None:
                self._on_alloc(str(func), nbytes)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


class PeakMemoryTracker:
    """Context manager measuring peak live tensor bytes above what was alive at entry.

    Use ``mark(name)`` between phases (e.g. after forward) to record the bytes alive at that point
    and the peak of the phase that just ended; the next phase's peak starts from there.

    Args:
        device: device whose memory is measured; ``cuda`` devices use the allocator statistics,
            anything else the CPU storage tracker. Default: ``cpu``.
        on_alloc: optional callback ``(op_name, nbytes)`` for each storage created (CPU only;
            for debugging and itemised traces).

    Attributes (valid after exit; also readable inside the region):
        peak_bytes: largest bytes alive at once, above the entry baseline.
        current_bytes: bytes alive now (at exit: created inside and still alive, e.g. ``.grad``).
        baseline_bytes: bytes allocated at entry (CUDA), ``None`` on the CPU (not measured).
        marks: ``{name: bytes alive at the mark}``.
        phase_peaks: ``{name: peak bytes of the phase ending at that mark}``; the phase after the
            last mark is named ``"end"``.

    Raises:
        RuntimeError: when entered twice, or when ``mark`` is called outside the region.

    Memory: the CPU tracker holds one weak reference per live storage; it allocates no tensors.

    Reference: docs/design.md §8, docs/style.md §7.
    """

    def __init__(self, device: str | torch.device = "cpu", *,
                 on_alloc: Callable[[str, int], None] | None = None) -> None:
        """Create an unentered tracker; the arguments are described on the class."""
        self.device = torch.device(device)
        self.baseline_bytes: int | None = None
        self.marks: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self._on_alloc = on_alloc
        self._mode: _LiveStorageMode | None = None
        self._cuda_peak = 0
        self._cuda_current = 0
        self._phase_start_peak = 0
        self._entered = False
        self._inside = False
        self._final_current: int | None = None
        self._final_peak: int | None = None

    @property
    def is_cuda(self) -> bool:
        """True when the CUDA allocator statistics are used."""
        return self.device.type == "cuda"

    def __enter__(self) -> PeakMemoryTracker:
        """Start measuring (CUDA: read the baseline, reset the peak; CPU: install the tracker).

        Returns:
            This tracker.

        Raises:
            RuntimeError: when the tracker was entered before.
        """
        if self._entered:
            raise RuntimeError("PeakMemoryTracker can be entered only once; create a new one")
        self._entered = self._inside = True
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _LiveStorageMode(self._on_alloc)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop measuring: close the ``"end"`` phase, freeze the byte counts, drop the CPU tracker.

        Exceptions raised inside the region are not suppressed.
        """
        self._read()
        self._close_phase("end")
        self._final_current = self.current_bytes
        self._final_peak = self.peak_bytes
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        self._inside = False

    def _read(self) -> None:
        if self.is_cuda and self._inside:
            torch.cuda.synchronize(self.device)
            base = self.baseline_bytes or 0
            self._cuda_peak = max(self._cuda_peak,
                                  torch.cuda.max_memory_allocated(self.device) - base)
            self._cuda_current = torch.cuda.memory_allocated(self.device) - base

    def _close_phase(self, name: str) -> None:
        self.phase_peaks[name] = self._phase_peak()
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._mode is not None:
            self._mode.peak_bytes = self._mode.current_bytes
        self._phase_start_peak = self.current_bytes

    def _phase_peak(self) -> int:
        if self.is_cuda:
            base = self.baseline_bytes or 0
            return max(torch.cuda.max_memory_allocated(self.device) - base, self._cuda_current)
        assert self._mode is not None, "tracker not entered"
        return self._mode.peak_bytes

    def mark(self, name: str) -> int:
        """Record the bytes alive now under ``name`` and end the current phase.

        Returns:
            Bytes alive at the mark (above the baseline).

        Raises:
            RuntimeError: outside the ``with`` block.
        """
        if not self._inside:
            raise RuntimeError("PeakMemoryTracker.mark must be called inside the with block")
        self._read()
        self._close_phase(name)
        self.marks[name] = self.current_bytes
        return self.current_bytes

    @property
    def peak_bytes(self) -> int:
        """Largest bytes alive at once since entry, above the baseline."""
        if self._final_peak is not None:
            return self._final_peak
        if self.is_cuda:
            self._read()
            return max(self._cuda_peak, *self.phase_peaks.values(), 0)
        if self._mode is None:
            return 0
        return max(self._mode.peak_bytes, *self.phase_peaks.values(), 0)

    @property
    def current_bytes(self) -> int:
        """Bytes alive now; after exit, those created inside and alive at exit."""
        if self._final_current is not None:
            return self._final_current
        if self.is_cuda:
            self._read()
            return self._cuda_current
        return self._mode.current_bytes if self._mode is not None else 0
