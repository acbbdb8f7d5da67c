"""memfine's experts inside torchtitan's selective activation checkpointing (SAC).

torchtitan's ``SelectiveAC`` (the default of its MoE configs) wraps each transformer block in
``torch.utils.checkpoint`` with a selective policy: a ``TorchDispatchMode`` that sees every aten
op of the block and keeps the outputs of the compute-intensive ones (``mm``, ``_grouped_mm``,
...) until backward. It also sees the ops inside memfine's fused ``autograd.Function``, whose
forward deliberately drops its GEMM outputs (MoEBlaze: only x and H are saved, Y is never kept;
with chunks not even H): SAC would keep them all, for every chunk.

:func:`outside_selective_checkpoint` suspends SAC's dispatch mode around memfine's experts, in
forward and in SAC's recompute alike, so SAC neither caches nor replays their ops (the two passes
stay aligned: both skip them). The block is still checkpointed by SAC's outer frame: what
memfine's experts save for backward is dropped after forward and recomputed from the block input
in backward, as for every op SAC does not keep. Not applied while ``torch.compile`` traces (the
compiler partitions SAC regions itself).

Reference: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``; MoEBlaze §5
(what the fused experts save); docs/torchtitan.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

# torch 2.13's SAC modes: caching (forward) and cached (recompute). Private classes of
# torch.utils.checkpoint; torch is pinned exactly (constraints.txt).
_SAC_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


@contextlib.contextmanager
def outside_selective_checkpoint() -> Iterator[bool]:
    """Suspend the innermost dispatch mode while it is SAC's, for the ``with`` block.

    Yields:
        True when SAC's mode was suspended, False when none was active (or under compile).
    """
    if torch.compiler.is_compiling() or not isinstance(_get_current_dispatch_mode(),
                                                       _SAC_MODES):
        yield False
        return
    with _pop_mode_temporarily():
        yield True
