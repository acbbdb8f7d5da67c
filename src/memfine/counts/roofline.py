"""A roofline floor of an ATen op stream: per op, FLOPs and HBM bytes; per GPU, a time floor.

Each non-view ATen op is priced as max(FLOPs ÷ peak FLOP/s, bytes ÷ HBM bandwidth), and the floor
of a stream is the sum over its ops (no overlap between ops, no cache reuse across ops, no launch
cost). FLOPs: 2·m·n·k for a matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
``_grouped_mm`` and memfine's loop custom ops: every row multiplied once); every other op 0.
Bytes: the op's tensor inputs and outputs (numel × itemsize each; an in-place op's tensor is
read and written), except that an allocation writes nothing, a fill (``zeros_like``…) writes only
its output, and ``copy_``, ``out=`` and beta = 0 ``addmm_`` destinations are written, not read
(:func:`op_bytes`).
These are models of what a GPU would pay, not measurements.

``dim_map`` maps a counted size to a real one, so a stream counted at small dims (d, n divided
by a factor) is priced at the real dims: every tensor dim equal to a key is read as its value.

Peak numbers (:data:`GPUS`) are dense bf16 tensor-core FLOP/s, HBM bandwidth and capacity of the
SXM parts from NVIDIA's datasheets.

Legend: m, n, k the matrix product's sizes.
Reference: Williams et al., "Roofline" (CACM 2009); NVIDIA H100 and H200 datasheets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class GPU:
    """Peak dense bf16 FLOP/s and HBM bandwidth of one GPU, with their source.

    Attributes:
        name: the key in :data:`GPUS` (``h100``, ``h200``).
        flops_per_s: dense bf16 tensor-core FLOP/s (no sparsity).
        bytes_per_s: HBM bandwidth, bytes/s.
        source: where the numbers come from.
        memory_bytes: HBM capacity, bytes (what sets CUDA's default row block,
            :func:`memfine.config.default_block_bytes`).
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    source: str
    memory_bytes: int


GPUS: dict[str, GPU] = {
    "h100": GPU("h100", 989e12, 3.35e12,
                "NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16 (1,979 with sparsity), "
                "3.35 TB/s HBM3, 80 GB", 80 * 10**9),
    "h200": GPU("h200", 989e12, 4.8e12,
                "NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16 (1,979 with sparsity), "
                "4.8 TB/s HBM3e, 141 GB", 141 * 10**9),
}
"""The GPUs a roofline floor is priced for (``roofline_ms_<name>`` columns)."""


def gpu(name: str) -> GPU:
    """The :class:`GPU` called ``name``.

    Raises:
        ValueError: for a name not in :data:`GPUS`.
    """
    if name not in GPUS:
        raise ValueError(f"roofline GPU must be one of {tuple(GPUS)}, got {name!r}")
    return GPUS[name]


def _dims(t: torch.Tensor, dim_map: Mapping[int, int]) -> list[int]:
    return [dim_map.get(int(s), int(s)) for s in t.shape]


def tensor_bytes(t: torch.Tensor, dim_map: Mapping[int, int] | None = None) -> int:
    """Bytes of ``t``: numel × itemsize, its dims read through ``dim_map``."""
    return math.prod(_dims(t, dim_map or {})) * t.element_size()


_MATMULS = {"mm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2),
            "baddbmm_": (1, 2), "_grouped_mm": (0, 1), "grouped_mm_loop": (0, 1),
            "grouped_weight_grad_loop": (0, 1)}


def op_flops(name: str, args: tuple[Any, ...], dim_map: Mapping[int, int] | None = None) -> int:
    """FLOPs of one ATen op (``name``: its overload packet, e.g. ``mm``); 0 unless a product.

    Matrix products count 2·m·n·k: ``mm``/``addmm`` (m, k)·(k, n); ``bmm``/``baddbmm`` b of
    them; ``_grouped_mm`` 2-D × 3-D (S, K)·(G, K, N) → 2·S·K·N, 2-D × 2-D (M, S)·(S, N) →
    2·M·S·N (each row of the ragged dim once), 3-D × 3-D G·2·M·K·N; the loop custom ops as
    their grouped forms.
    """
    where = _MATMULS.get(name)
    if where is None:
        return 0
    a, b = args[where[0]], args[where[1]]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return 0
    da, db = _dims(a, dim_map or {}), _dims(b, dim_map or {})
    if name == "grouped_weight_grad_loop":  # x (S, I), dY (S, O)
        return 2 * da[0] * da[1] * db[1]
    if len(da) == 2 and len(db) == 2:
        return 2 * da[0] * da[1] * db[1]
    if len(da) == 2 and len(db) == 3:  # rows × per-group weight
        return 2 * da[0] * da[1] * db[2]
    if len(da) == 3 and len(db) == 2:
        return 2 * da[1] * da[2] * db[1]
    return 2 * da[0] * da[1] * da[2] * db[-1]


_UNWRITTEN = frozenset({"empty", "empty_like", "new_empty", "empty_strided",
                        "new_empty_strided"})
"""Allocations that write nothing: no bytes."""
_FILLS = frozenset({"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full",
                    "full_like", "new_full", "fill_", "zero_", "arange", "scalar_tensor"})
"""Ops that only write their output (their tensor input gives its shape, or is overwritten)."""


def op_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
             dim_map: Mapping[int, int] | None = None) -> int:
    """Bytes of an op's tensor inputs and outputs (an in-place op's tensor counts twice).

    Except: allocations (``empty``…) 0; fills (``zeros_like``, ``new_zeros``, ``fill_``…) their
    output only; ``copy_`` and ``addmm_`` with beta = 0 their destination once (written, not
    read); an ``out=`` tensor once, as an output.
    """
    if name in _UNWRITTEN:
        return 0
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if name in _FILLS:
        inputs: list[Any] = []
    elif name == "copy_":
        inputs = [args[1]]
    elif name in ("addmm_", "baddbmm_") and kwargs.get("beta", 1) == 0:
        inputs = list(args[1:3])  # beta = 0: self is written, not read
    else:
        inputs = [*tree_leaves(args), *tree_leaves({k: v for k, v in kwargs.items()
                                                   if k != "out"})]
    return sum(tensor_bytes(t, dim_map) for t in (*inputs, *outs) if isinstance(t, torch.Tensor))


def floor_ms(traffic: list[tuple[int, int]], name: str) -> float:
    """Σ over ops of max(FLOPs ÷ peak, bytes ÷ bandwidth) on GPU ``name``, in milliseconds.

    Args:
        traffic: one (FLOPs, bytes) pair per non-view op.
        name: a key of :data:`GPUS`.

    Raises:
        ValueError: for an unknown GPU name.
    """
    g = gpu(name)
    return 1e3 * sum(max(f / g.flops_per_s, b / g.bytes_per_s) for f, b in traffic)
