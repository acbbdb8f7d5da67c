"""Count what a GPU would pay, on any device: ATen ops, host syncs, ``torch._grouped_mm`` calls.

:class:`OpCounter` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (a context
manager). Under it every ATen operator that reaches the dispatcher below autograd is counted, per
phase: ``forward``, or ``backward`` while the autograd engine runs a graph task (recompute in
backward counts as backward). On a GPU each non-view op is about one kernel launch.

What is counted, per phase (:class:`PhaseCounts`):

- ``ops``: non-view ATen ops by name (an op whose schema returns an alias of an input, such as
  ``view``, ``t``, ``slice``, ``expand``, ``detach``, ``unbind``, is a *view* and only counted in
  ``view_ops``). Composite ops are seen after their decomposition (``matmul`` → ``mm`` + views).
  Metadata-only ops that are not aliases by schema (``empty``, ``_unsafe_view``) count as
  non-view. A custom op (``memfine::grouped_mm_loop``) counts as one op: its body runs below the
  mode.
- ``syncs``: operations that make the host wait for the device, by kind:

  - ``item``: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ``if t:``);
  - ``tolist``: ``Tensor.tolist()`` (a Python-level call: on the CPU it never reaches the
    dispatcher, so the counter wraps ``torch.Tensor.tolist`` while active);
  - ``to_cpu``: ``Tensor.cpu()``, ``.numpy()`` and ``.to("cpu")`` / ``.to(device=cpu)`` called
    from Python (wrapped likewise; counted whatever the tensor's device, as the call would copy
    device → host on a GPU), and dispatched copies from a non-CPU tensor into a CPU one;
  - ``nonzero``: ``aten.nonzero`` (``torch.nonzero``, one-argument ``torch.where``);
  - ``bool_mask_index``: ``aten.index`` / ``index_put_`` with a bool or uint8 index, and
    ``masked_select`` (``x[mask]``, ``x[mask] = v``);
  - ``repeat_interleave``: ``aten.repeat_interleave.Tensor`` without ``output_size``;
  - ``data_dependent``: any other op tagged ``dynamic_output_shape`` or
    ``data_dependent_output`` (``unique``, ``bincount``, ``equal``, ...).

  Calls made inside a wrapped Python-level entry point count once, as that entry point.
- ``grouped_mm``: every ``aten._grouped_mm`` call, with whether CUDA's CUTLASS fast path would
  take it (:func:`memfine.counts.grouped_mm_rules.cuda_grouped_mm_call`).
- ``traffic``: per non-view op its FLOPs and the bytes of its tensor inputs and outputs
  (:mod:`memfine.counts.roofline`), the dims read through the counter's ``dim_map``; summed as
  ``hbm_bytes`` and priced per GPU by :meth:`PhaseCounts.roofline_ms`.

Not counted: work outside the dispatcher (Python, the autograd engine's own bookkeeping),
allocator events, and ops that a compiled graph fuses (count eagerly). The mode also changes a
little of what it watches: every op output gets a Python wrapper (see
:mod:`memfine.measure.peak`), which can turn an in-place gradient accumulation into an
out-of-place one.

Reference: docs/design.md §8 (measurement on CPU).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfine.counts.grouped_mm_rules import GroupedMMCall, cuda_grouped_mm_call
from memfine.counts.roofline import floor_ms, op_bytes, op_flops

PHASES = ("forward", "backward")
SYNC_KINDS = ("item", "tolist", "to_cpu", "nonzero", "bool_mask_index", "repeat_interleave",
              "data_dependent")
_aten = torch.ops.aten
_DATA_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_MASK_DTYPES = (torch.bool, torch.uint8)


@dataclass
class PhaseCounts:
    """What one phase did.

    Attributes:
        ops: non-view ATen op name (``aten.mm.default``) → calls.
        view_ops: calls of view ops.
        syncs: sync kind (:data:`SYNC_KINDS`) → count.
        grouped_mm: every ``torch._grouped_mm`` call, in order.
        traffic: (FLOPs, bytes read + written) of every non-view op, in order.
    """

    ops: Counter[str] = field(default_factory=Counter)
    view_ops: int = 0
    syncs: Counter[str] = field(default_factory=Counter)
    grouped_mm: list[GroupedMMCall] = field(default_factory=list)
    traffic: list[tuple[int, int]] = field(default_factory=list)

    @property
    def hbm_bytes(self) -> int:
        """Bytes the non-view ops read and write (their tensor inputs and outputs)."""
        return sum(b for _, b in self.traffic)

    def roofline_ms(self, gpu: str) -> float:
        """Roofline floor on ``gpu`` (:func:`memfine.counts.roofline.floor_ms`), ms."""
        return floor_ms(self.traffic, gpu)

    @property
    def non_view_ops(self) -> int:
        """Calls of non-view ATen ops."""
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        """Host syncs of every kind."""
        return sum(self.syncs.values())

    def merged(self, other: PhaseCounts) -> PhaseCounts:
        """The sum of two phases' counts (e.g. forward + backward)."""
        return PhaseCounts(ops=self.ops + other.ops, view_ops=self.view_ops + other.view_ops,
                           syncs=self.syncs + other.syncs,
                           grouped_mm=self.grouped_mm + other.grouped_mm,
                           traffic=self.traffic + other.traffic)


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in _MASK_DTYPES


def _leaves_cpu(src: object, dst_device: torch.device | str | int | None) -> bool:
    """True for a copy from a non-CPU tensor to the CPU."""
    return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
            and dst_device is not None and torch.device(dst_device).type == "cpu")


def sync_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The host-sync kind of one dispatched ATen call (:data:`SYNC_KINDS`), or ``None``.

    Args:
        func: the ``OpOverload`` (e.g. ``aten.nonzero.default``).
        args: its positional arguments.
        kwargs: its keyword arguments.
    """
    name = func._overloadpacket.__name__
    if func is _aten._local_scalar_dense.default:
        return "item"
    if name == "nonzero":
        return "nonzero"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return "bool_mask_index" if any(_is_mask(i) for i in indices) else None
    if name == "masked_select":
        return "bool_mask_index"
    if func is _aten.repeat_interleave.Tensor:
        given = kwargs.get("output_size", args[1] if len(args) > 1 else None)
        return "repeat_interleave" if given is None else None
    if name == "_to_copy":
        return "to_cpu" if _leaves_cpu(args[0], kwargs.get("device")) else None
    if name == "copy_":
        return "to_cpu" if _leaves_cpu(args[1], args[0].device) else None
    if any(tag in func.tags for tag in _DATA_TAGS):
        return "data_dependent"
    return None


def _to_cpu_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when ``Tensor.to(*args, **kwargs)`` names the CPU as its device."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            with contextlib.suppress(RuntimeError):
                return torch.device(value).type == "cpu"
    return False


class OpCounter(TorchDispatchMode):
    """Count non-view ATen ops, host syncs and ``_grouped_mm`` calls per phase (module doc).

    Use as ``with OpCounter() as counter: ...``; then ``counter.counts["forward"]``,
    ``counter.counts["backward"]`` or :meth:`total`. While active it also wraps
    ``torch.Tensor.tolist``, ``.cpu``, ``.numpy`` and ``.to`` (restored on exit) to count the
    host reads that do not reach the dispatcher on the CPU. Not thread-safe; do not nest.

    Args:
        phase: force every count into this phase (``None``: ``backward`` inside an autograd
            graph task, else ``forward``).
        dim_map: counted size → real size for the traffic (bytes and FLOPs) of a stream
            counted at reduced dims (:mod:`memfine.counts.roofline`); ``None``: as counted.

    Raises:
        ValueError: for a phase not in :data:`PHASES`.
    """

    def __init__(self, phase: str | None = None, dim_map: dict[int, int] | None = None) -> None:
        """Start with zero counts."""
        super().__init__()
        self.dim_map = dict(dim_map or {})
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES} or None, got {phase!r}")
        self.forced_phase = phase
        self.counts: dict[str, PhaseCounts] = {p: PhaseCounts() for p in PHASES}
        self._python_entry = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    @property
    def phase(self) -> str:
        """The phase counts go to now."""
        if self.forced_phase is not None:
            return self.forced_phase
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def total(self) -> PhaseCounts:
        """Forward and backward together."""
        return self.counts["forward"].merged(self.counts["backward"])

    def _wrap(self, name: str, kind: str,
              when: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None) -> None:
        original = getattr(torch.Tensor, name)
        self._saved[name] = original
        counter = self

        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._python_entry or (when is not None and not when(args, kwargs)):
                return original(tensor, *args, **kwargs)
            counter.counts[counter.phase].syncs[kind] += 1
            counter._python_entry += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._python_entry -= 1

        setattr(torch.Tensor, name, wrapper)

    def __enter__(self) -> OpCounter:
        """Activate the mode and wrap the Python-level host reads."""
        self._wrap("tolist", "tolist")
        self._wrap("cpu", "to_cpu")
        self._wrap("numpy", "to_cpu")
        self._wrap("to", "to_cpu", _to_cpu_call)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        """Deactivate the mode and restore the wrapped methods."""
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        """Count one ATen call, then run it."""
        kwargs = kwargs or {}
        counts = self.counts[self.phase]
        if func.is_view:
            counts.view_ops += 1
        else:
            counts.ops[str(func)] += 1
        kind = None if self._python_entry else sync_kind(func, args, kwargs)
        if kind is not None:
            counts.syncs[kind] += 1
        if func is _aten._grouped_mm.default:
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
            self._python_entry += 1  # its read of the offsets is the counter's, not the program's
            try:
                counts.grouped_mm.append(cuda_grouped_mm_call(args[0], args[1], offs, out_dtype,
                                                              self.phase))
            finally:
                self._python_entry -= 1
        out = func(*args, **kwargs)
        if not func.is_view:
            name = func._overloadpacket.__name__
            counts.traffic.append((op_flops(name, args, self.dim_map),
                                   op_bytes(name, args, kwargs, out, self.dim_map)))
        return out

