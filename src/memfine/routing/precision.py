"""fp32 routing under mixed precision, and per-expert counts with a static shape.

- :func:`fp32_routing` runs a routing function with autocast disabled on its input's device, so
  the router's linear, scores, top-k, renormalisation and losses stay in fp32 inside a
  ``torch.autocast`` region (whose lower-precision list includes ``linear``: a bf16 router
  linear flips the choice between experts whose logits differ by less than bf16's resolution).
- :class:`FP32BuffersMixin` keeps a module's floating buffers (the router's selection bias, and
  any expert bias of a load-balancing update) in fp32 through ``module.to(dtype)``, ``.half()``
  and ``.bfloat16()``: a bias of 6.8 ± 0.2 has a bf16 spacing of 0.03, so a cast collapses
  nearby values and moves tokens to other experts.
- :func:`count_per_expert` counts assignments with ``scatter_add_`` into a fixed (E,) tensor; its
  output shape does not depend on the data (``torch.bincount``'s does), so ``torch.compile``
  traces it without a graph break.

Legend: M (token, slot) pairs, E experts.
Reference: docs/design.md §2 (router logits in fp32, always).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

_F = TypeVar("_F", bound=Callable[..., Any])


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def fp32_routing(fn: _F) -> _F:
    """Decorate a routing function so that it runs with autocast disabled on its device.

    The device is that of the first tensor among the positional arguments; the function itself
    upcasts its inputs (autocast is only switched off, nothing is cast here). Outside autocast
    the decorator changes nothing.

    Args:
        fn: a function (or method) with at least one tensor positional argument.

    Returns:
        The wrapped function.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = _first_tensor(args)
        device_type = t.device.type if t is not None else "cpu"
        if not torch.amp.is_autocast_available(device_type):
            return fn(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class FP32BuffersMixin(nn.Module):
    """Keeps this module's own floating-point buffers at fp32 (or float64) across dtype casts.

    ``module.to(torch.bfloat16)``, ``.half()`` and ``.bfloat16()`` cast parameters as usual; the
    module's direct floating buffers are re-made from their values before the cast, in
    ``promote_types(new dtype, fp32)`` on the new device, so they stay exact. ``.double()``
    gives float64 buffers (float64 reference runs).
    """

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> FP32BuffersMixin:
        """Apply ``fn`` as :meth:`torch.nn.Module._apply`, then restore fp32 buffers.

        Args:
            fn: the per-tensor conversion (from ``to``, ``half``, ``cuda``, ...).
            recurse: also apply to children.

        Returns:
            self.
        """
        before = {name: b for name, b in self._buffers.items()
                  if b is not None and b.is_floating_point()}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is None or new.dtype == old.dtype:
                continue
            dtype = torch.promote_types(new.dtype, torch.float32)
            self._buffers[name] = old.to(device=new.device, dtype=dtype)
        return self


def count_per_expert(ids_M: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64 number of entries of ``ids_M`` equal to each expert id in [0, E).

    Args:
        ids_M: integer tensor of any shape (flattened); ids outside [0, E) (sentinels) are not
            counted.
        num_experts: E.

    Returns:
        (E,) int64 counts on ids' device. Equal to ``torch.bincount`` over the valid ids, with an
        output shape fixed by E (traceable by ``torch.compile``); integer sums are exact in any
        order, so the result is deterministic.
    """
    # Shift ids by one into [0, E + 1]: bin 0 takes every id < 0 and bin E + 1 every id ≥ E.
    key_M = ids_M.reshape(-1).long().clamp(-1, num_experts).add_(1)
    counts = torch.zeros(num_experts + 2, dtype=torch.int64, device=key_M.device)
    one = torch.ones((), dtype=torch.int64, device=key_M.device)
    counts.scatter_add_(0, key_M, one.expand(key_M.shape[0]))  # NOTE(memory): no (M,) ones
    return counts[1:num_experts + 1]
