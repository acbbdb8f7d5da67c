"""Bytes of tensors saved for backward, measured with saved-tensor hooks.

Every tensor that autograd saves while the tracker is active (``ctx.save_for_backward`` in custom
Functions and the inputs/outputs that built-in ops keep) passes through a pack hook. The tracker
records each underlying storage once, keyed by ``untyped_storage()._cdata`` (two views of one
buffer keep one buffer alive), and leaves out parameters: ``nn.Parameter`` objects, views of them,
and any storage of the tensors passed as ``exclude``. It keeps no reference to the tensors, so it
does not change what is alive. It works on real tensors and under ``FakeTensorMode`` (fake
storages have sizes and distinct ids).

Units: every byte count is an ``int`` in bytes; human tables use MiB = 2^20 bytes.
Reference: docs/design.md §8 (saved-tensor hooks give exact saved bytes on CPU); docs/style.md §7.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from memfine.units import MiB


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One storage kept alive for backward.

    Attributes:
        shape: shape of the first saved tensor seen on this storage.
        dtype: its dtype.
        nbytes: bytes of the whole storage (what stays allocated until backward), in bytes.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True, slots=True)
class SavedGroup:
    """Saved storages that share a shape and dtype.

    Attributes:
        shape: tensor shape.
        dtype: tensor dtype.
        count: number of distinct storages.
        nbytes: their total size, in bytes.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    count: int
    nbytes: int


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base
    return isinstance(t, nn.Parameter) or (base is not None and isinstance(base, nn.Parameter))


class SavedTensorsTracker:
    """Context manager that records the storages saved for backward inside it.

    Use one tracker around one forward (storage ids of freed buffers may be reused by later
    allocations, so a tracker spanning a backward and a second forward can undercount).

    Args:
        exclude: tensors whose storages are not counted (e.g. ``model.parameters()``, or weights
            passed as plain tensors). ``nn.Parameter`` objects and their views are always excluded.

    Example:
        >>> with SavedTensorsTracker(exclude=layer.parameters()) as saved:
        ...     out = layer(x)
        >>> saved.total_bytes  # int, bytes

    Memory: a few Python objects per saved storage; no tensor references.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        """Record the storages of ``exclude``; nothing is hooked until the tracker is entered."""
        self._exclude = {_storage_key(t) for t in exclude}
        self._items: dict[int, SavedTensor] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in self._exclude or key in self._items or _is_parameter(t):
            return t
        nbytes = int(t.untyped_storage().nbytes())
        self._items[key] = SavedTensor(shape=tuple(t.shape), dtype=t.dtype, nbytes=nbytes)
        return t

    def __enter__(self) -> SavedTensorsTracker:
        """Install the saved-tensor hooks."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Remove the hooks (what was recorded stays readable)."""
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None

    @property
    def items(self) -> list[SavedTensor]:
        """One :class:`SavedTensor` per distinct saved storage, in the order first saved."""
        return list(self._items.values())

    @property
    def total_bytes(self) -> int:
        """Bytes of all distinct saved storages (parameters and excluded tensors left out)."""
        return sum(item.nbytes for item in self._items.values())

    def groups(self) -> list[SavedGroup]:
        """Saved storages grouped by (shape, dtype), largest total first."""
        acc: dict[tuple[tuple[int, ...], torch.dtype], tuple[int, int]] = {}
        for item in self._items.values():
            count, nbytes = acc.get((item.shape, item.dtype), (0, 0))
            acc[(item.shape, item.dtype)] = (count + 1, nbytes + item.nbytes)
        groups = [SavedGroup(shape=shape, dtype=dtype, count=count, nbytes=nbytes)
                  for (shape, dtype), (count, nbytes) in acc.items()]
        return sorted(groups, key=lambda g: -g.nbytes)

    def table(self) -> str:
        """A plain-text table: shape, dtype, count, MiB, one line per group, then the total."""
        lines = [f"{'shape':<24} {'dtype':<16} {'count':>5} {'MiB':>10}"]
        for g in self.groups():
            lines.append(f"{str(g.shape):<24} {str(g.dtype):<16} {g.count:>5} "
                         f"{g.nbytes / MiB:>10.3f}")
        lines.append(f"{'total':<24} {'':<16} {len(self._items):>5} "
                     f"{self.total_bytes / MiB:>10.3f}")
        return "\n".join(lines)


@contextmanager
def track_saved_tensors(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensorsTracker]:
    """Context-manager function form of :class:`SavedTensorsTracker`.

    Use it as ``with track_saved_tensors() as saved:``.

    Args:
        exclude: tensors whose storages are not counted (parameters are always left out).

    Yields:
        The active :class:`SavedTensorsTracker`; read ``total_bytes`` (bytes) after the block.
    """
    with SavedTensorsTracker(exclude) as tracker:
        yield tracker
