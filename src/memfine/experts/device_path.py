"""Run, on the CPU, the fused experts path that another device takes (for counting its ops).

The CPU's path differs from every other device's in three host-side choices: the fused experts
sum rows with ``index_add_`` and cap the backward's block rows (``memfine.config.moe``'s
``CPU_MAX_BLOCK_ROWS``), and the router ranks its top-k by int64 keys instead of a stable sort
(``memfine.config.routing``'s ``SORT_TOP_K_ON_CPU``). :func:`device_path` switches all three, and
the default block byte target, for a ``with`` block, so that the ``counts`` suite counts a GPU's
kernels on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memfine.config import moe as config_moe
from memfine.config import routing as config_routing
from memfine.experts import function as fused_function


@contextlib.contextmanager
def device_path(device: str, default_block: int | None = None) -> Iterator[None]:
    """Run, on the CPU, the fused path that ``device`` takes.

    ``cuda``: the per-token gather combine of the forward's output and the backward's dx
    (:func:`memfine.experts.rows.add_token_rows_`), without the CPU's ``index_add_`` and row cap,
    and the router's top-k by the stable sort.
    ``default_block``: the byte target the device default (``backward_block_bytes=None``)
    resolves to meanwhile (the counted device's, at the counted dims), so that paths with no
    block setting of their own (transformers' experts backend) count the device's blocks.

    Side effects: sets module globals of :mod:`memfine.experts.function`,
    :mod:`memfine.config.moe` and :mod:`memfine.config.routing` (process-wide, not thread-safe);
    restored on exit.
    """
    ff, cm, cr = fused_function, config_moe, config_routing
    saved = (ff.DEVICE_SUM_ON_CPU, cm.DEFAULT_BACKWARD_BLOCK_BYTES, cm.CPU_MAX_BLOCK_ROWS,
             cr.SORT_TOP_K_ON_CPU)
    ff.DEVICE_SUM_ON_CPU = cr.SORT_TOP_K_ON_CPU = device != "cpu"
    cm.CPU_MAX_BLOCK_ROWS = cm.CPU_MAX_BLOCK_ROWS if device == "cpu" else None
    cm.DEFAULT_BACKWARD_BLOCK_BYTES = default_block or cm.DEFAULT_BACKWARD_BLOCK_BYTES
    try:
        yield
    finally:
        (ff.DEVICE_SUM_ON_CPU, cm.DEFAULT_BACKWARD_BLOCK_BYTES, cm.CPU_MAX_BLOCK_ROWS,
         cr.SORT_TOP_K_ON_CPU) = saved
