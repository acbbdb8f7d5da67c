"""Run, on the CPU, the fused experts path that another device takes (for counting its ops).

The CPU's fused path differs from every other device's in two host-side choices: it sums rows
with ``index_add_`` and caps the backward's block rows (``memfine.config.moe``'s
``CPU_MAX_BLOCK_ROWS``). :func:`device_path` switches both, and the default block byte target,
for a ``with`` block, so that the ``counts`` suite counts a GPU's kernels on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memfine.config import moe as config_moe
from memfine.experts import function as fused_function


@contextlib.contextmanager
def device_path(device: str, default_block: int | None = None) -> Iterator[None]:
    """Run, on the CPU, the fused path that ``device`` takes.

    ``cuda``: the per-token gather combine of the forward's output and the backward's dx
    (:func:`memfine.experts.rows.add_token_rows_`), without the CPU's ``index_add_`` and row cap.
    ``default_block``: the byte target the device default (``backward_block_bytes=None``)
    resolves to meanwhile (the counted device's, at the counted dims), so that paths with no
    block setting of their own (transformers' experts backend) count the device's blocks.

    Side effects: sets module globals of :mod:`memfine.experts.function` and
    :mod:`memfine.config.moe` (process-wide, not thread-safe); restored on exit.
    """
    ff, cm = fused_function, config_moe
    saved = ff.DEVICE_SUM_ON_CPU, cm.DEFAULT_BACKWARD_BLOCK_BYTES, cm.CPU_MAX_BLOCK_ROWS
    ff.DEVICE_SUM_ON_CPU = device != "cpu"
    cm.CPU_MAX_BLOCK_ROWS = cm.CPU_MAX_BLOCK_ROWS if device == "cpu" else None
    cm.DEFAULT_BACKWARD_BLOCK_BYTES = default_block or cm.DEFAULT_BACKWARD_BLOCK_BYTES
    try:
        yield
    finally:
        ff.DEVICE_SUM_ON_CPU, cm.DEFAULT_BACKWARD_BLOCK_BYTES, cm.CPU_MAX_BLOCK_ROWS = saved
