"""Frozen expert weights held 4-bit (NF4), dequantised per row block inside the fused path.

QLoRA (Dettmers et al. 2023) keeps the frozen base weights in 4-bit NormalFloat (NF4: 16 levels
at the quantiles of N(0, 1), one fp32 absmax per block of ``block_size`` consecutive values) and
trains LoRA adapters on top. Here an (E, I, O) expert weight is quantised flattened (E·I·O
values, ``bitsandbytes.functional.quantize_4bit``), so with I·O divisible by the block size each
expert owns a contiguous slice of the packed codes (I·O / 2 bytes) and of the absmax
(I·O / block_size floats). :class:`NF4Experts` stands where the fused Function reads an expert
weight: ``w[held]`` (``held`` the slice of experts a row block's GEMMs take,
:meth:`memfine.experts.rows.RowBlocks.experts_of`) is an :class:`NF4Block` whose grouped
product (:func:`memfine.ops.grouped.grouped_mm`) dequantises those experts
(``bitsandbytes.functional.dequantize_4bit`` on their slices) into a transient in the compute
dtype, freed after the product: all of them at once when they are at most the window m
(:func:`memfine.config.lora.dequant_window`, from the row block's size), else m at a time, each
window's experts multiplied into their rows of the product. So at most m experts exist in full
precision at once, whatever the routing.

The library: bitsandbytes ≥ 0.50 quantises and dequantises NF4 on the CPU and on CUDA with the
same call (torchao 0.18's NF4 tensor is missing from its wheel here and its CUDA extensions do not
load on a CPU machine). It is imported on first use (``pip install 'memfine[qlora]'``).

Legend: E experts, I / O a weight's input / output features (w_up: d, G; w_down: n, d).
Reference: Dettmers et al. 2023 (QLoRA: NF4, block-wise absmax); MoEBlaze §4.2 (row blocks).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from memfine._optional import require
from memfine.config.lora import QUANT_BLOCK_SIZES, dequant_window
from memfine.ops.grouped import grouped_mm

# bitsandbytes logs this once at import on CPUs with AVX512-BF16 when the optional ``kernels``
# package for its CPU 4-bit matmul is missing; memfine never runs that matmul (it only quantises
# and dequantises), so exactly this record is dropped while memfine imports bitsandbytes.
_KERNELS_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNELS_MESSAGE = "Failed to load CPU gemm_4bit_forward"


def _not_kernels_record(record: logging.LogRecord) -> bool:
    """False for bitsandbytes' missing-CPU-matmul-kernels record only."""
    return not str(record.msg).startswith(_KERNELS_MESSAGE)


@contextlib.contextmanager
def without_kernels_note() -> Iterator[None]:
    """Drop bitsandbytes' missing-CPU-matmul-kernels log record, only it, within the block.

    For a first import of bitsandbytes, directly or through another package (``import peft``).
    """
    log = logging.getLogger(_KERNELS_LOGGER)
    log.addFilter(_not_kernels_record)
    try:
        yield
    finally:
        log.removeFilter(_not_kernels_record)


def _functional() -> Any:
    with without_kernels_note(), warnings.catch_warnings():  # torch's deprecation warnings
        warnings.simplefilter("ignore")  # raised by the import
        require("bitsandbytes")
        return require("bitsandbytes.functional")


def check_quantisable(name: str, shape: tuple[int, ...], block_size: int,
                      field: str = "LoRAConfig.base_quant") -> None:
    """Raise ValueError unless each expert of an (E, I, O) weight is whole quantisation blocks.

    Raises:
        ValueError: naming ``field``, the weight, I·O and what is allowed, e.g.
            ``LoRAConfig.base_quant='nf4' needs w_up's d·G = 24 (per expert) divisible by the
            block size 64, got 24 % 64 = 24``.
    """
    if block_size not in QUANT_BLOCK_SIZES:
        raise ValueError(f"LoRAConfig.base_quant_block_size must be one of "
                         f"{QUANT_BLOCK_SIZES}, got {block_size!r}")
    dims = "d·G" if name == "w_up" else "n·d"
    per = shape[1] * shape[2]
    if per % block_size:
        raise ValueError(f"{field}='nf4' needs {name}'s {dims} = {per} (per expert) divisible "
                         f"by the block size {block_size}, got {per} % {block_size} = "
                         f"{per % block_size}")


@dataclass(frozen=True, eq=False, slots=True)
class NF4Experts:
    """An (E, I, O) expert weight held NF4; ``w[held]`` dequantises the experts ``held``.

    Attributes:
        codes: (E·I·O / 2,) uint8 packed 4-bit codes (two values per byte), expert-major.
        absmax: (E·I·O / block_size,) fp32 per-block scales.
        code: (16,) fp32 NF4 levels (bitsandbytes').
        shape: (E, I, O) of the full-precision weight.
        dtype: the dtype dequantised to (the compute dtype: the base weights' before
            quantisation).
        block_size: values per absmax block.
        window: m, the most experts dequantised at once (None: all E).

    Memory: resident E·I·O / 2 + 4·E·I·O / block_size bytes (codes + absmax; the 16 levels
    are bitsandbytes' shared table); ``w[held]``'s product a transient min(e1 − e0, m)·I·O·D_t.
    """

    codes: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int = 64
    window: int | None = None

    @classmethod
    def quantize(cls, w_EIO: torch.Tensor, name: str, block_size: int = 64) -> NF4Experts:
        """Quantise ``w_EIO`` (E, I, O) to NF4 (deterministic: the same weight, the same codes).

        Raises:
            ValueError: when I·O is not a multiple of ``block_size`` (:func:`check_quantisable`).
        """
        check_quantisable(name, tuple(w_EIO.shape), block_size)
        with torch.no_grad():
            packed, state = _functional().quantize_4bit(
                w_EIO.detach().contiguous().reshape(-1), blocksize=block_size, quant_type="nf4")
        return cls(packed.reshape(-1), state.absmax, state.code, w_EIO.shape, w_EIO.dtype,
                   block_size)

    @property
    def device(self) -> torch.device:
        """The codes' device."""
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed codes + absmax."""
        return self.codes.nbytes + self.absmax.nbytes

    def dequantize(self, e0: int = 0, e1: int | None = None) -> torch.Tensor:
        """(e1 − e0, I, O) full-precision experts [e0, e1) in :attr:`dtype` (a new tensor)."""
        E, i_dim, o_dim = self.shape
        e1 = E if e1 is None else e1
        per = i_dim * o_dim
        F = _functional()
        state = F.QuantState(absmax=self.absmax[e0 * per // self.block_size:
                                                e1 * per // self.block_size],
                             shape=torch.Size([(e1 - e0) * per]), code=self.code,
                             blocksize=self.block_size, quant_type="nf4", dtype=self.dtype)
        # NOTE(memory): the only allocation: the (e1 − e0)·I·O output
        out = F.dequantize_4bit(self.codes[e0 * per // 2:e1 * per // 2], state)
        return cast(torch.Tensor, out).view(e1 - e0, i_dim, o_dim)

    def experts(self, e0: int, e1: int) -> NF4Experts:
        """Experts [e0, e1) as their own :class:`NF4Experts` (views of the codes and absmax)."""
        per = self.shape[1] * self.shape[2]
        return replace(self, codes=self.codes[e0 * per // 2:e1 * per // 2],
                       absmax=self.absmax[e0 * per // self.block_size:e1 * per // self.block_size],
                       shape=torch.Size((e1 - e0, *self.shape[1:])))

    def __getitem__(self, held: slice) -> torch.Tensor:
        """The experts of ``held`` (a unit-step slice) as ``w[held]``: an :class:`NF4Block`."""
        e0, e1, step = held.indices(self.shape[0])
        assert step == 1, "row blocks take contiguous experts"
        return cast(torch.Tensor, NF4Block(self, e0, e1))

    def as_weight(self) -> torch.Tensor:
        """This object typed as the weight tensor the fused Function reads.

        It answers ``w[held]`` and ``w.shape`` for the frozen full-precision weight, which is
        never differentiated.
        """
        return cast(torch.Tensor, self)


@dataclass(frozen=True, eq=False, slots=True)
class NF4Block:
    """Experts [e0, e1) of an :class:`NF4Experts`, dequantised only inside their product.

    ``grouped_mm(x, w[held], offsets)`` and ``grouped_mm(x, w[held].transpose(1, 2), offsets)``
    call :meth:`grouped_mm` (:func:`memfine.ops.grouped.grouped_mm` hands over any operand
    that is not a tensor).
    """

    experts: NF4Experts
    e0: int
    e1: int
    transposed: bool = False

    def transpose(self, dim0: int, dim1: int) -> torch.Tensor:
        """The same experts multiplied transposed, (O, I) each (``transpose(1, 2)`` only)."""
        assert {dim0, dim1} == {1, 2}, "only the per-expert matrices transpose"
        return cast(torch.Tensor, NF4Block(self.experts, self.e0, self.e1, not self.transposed))

    def grouped_mm(self, x_SI: torch.Tensor, offsets: torch.Tensor, backend: str
                   ) -> torch.Tensor:
        """Y[rows of e] = X[rows of e] · W[e] (or W[e]ᵀ) for e in [e0, e1).

        Args:
            x_SI: (S, I) rows grouped by the experts [e0, e1).
            offsets: (e1 − e0 + 1,) int32 offsets of those rows, starting at 0, ending at S.
            backend: the grouped GEMM backend (one window).

        Returns:
            (S, O) in the dequantised dtype.

        Memory: at most m experts' (I, O) weights at once. Up to m experts: one grouped GEMM
        on them (its (S, O) product). More: the (S, O) output first, then per window of m
        experts their dequantised weights and one ``torch.mm`` per expert with rows written
        into its rows of the output (no other transient; the offsets read to the host, a sync
        off the CPU).
        """
        count = self.e1 - self.e0
        m = count if self.experts.window is None else self.experts.window
        if count <= m:
            w = self.experts.dequantize(self.e0, self.e1)
            return grouped_mm(x_SI, w.transpose(1, 2) if self.transposed else w, offsets,
                              backend)
        i_dim, o_dim = self.experts.shape[1:]
        out = x_SI.new_empty(x_SI.shape[0], i_dim if self.transposed else o_dim)
        rows = offsets.tolist()
        for j in range(0, count, m):
            w = self.experts.dequantize(self.e0 + j, self.e0 + min(count, j + m))
            for e in range(w.shape[0]):
                ra, rb = rows[j + e], rows[j + e + 1]
                if rb > ra:
                    torch.mm(x_SI[ra:rb], w[e].T if self.transposed else w[e],
                             out=out[ra:rb])
            del w  # NOTE(memory): one window's experts at a time
        return out


@dataclass(frozen=True, eq=False, slots=True)
class QuantizedBase:
    """The frozen 4-bit w_up (E, d, G) and w_down (E, n, d) of one experts module."""

    up: NF4Experts
    down: NF4Experts

    @classmethod
    def quantize(cls, w_up_EDG: torch.Tensor, w_down_END: torch.Tensor,
                 block_size: int = 64) -> QuantizedBase:
        """Quantise both weights (checks both shapes before quantising either)."""
        check_quantisable("w_up", tuple(w_up_EDG.shape), block_size)
        check_quantisable("w_down", tuple(w_down_END.shape), block_size)
        return cls(NF4Experts.quantize(w_up_EDG, "w_up", block_size),
                   NF4Experts.quantize(w_down_END, "w_down", block_size))

    @property
    def nbytes(self) -> int:
        """Resident bytes of both weights."""
        return self.up.nbytes + self.down.nbytes

    def stand_ins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_up, w_down) as empty ``meta`` tensors of the weights' shapes and dtype.

        They hold no bytes; the fused path's shape and dtype checks read them.
        """
        return (torch.empty(self.up.shape, dtype=self.up.dtype, device="meta"),
                torch.empty(self.down.shape, dtype=self.down.dtype, device="meta"))

    def experts(self, e0: int, e1: int) -> QuantizedBase:
        """Experts [e0, e1) of both weights (an expert-parallel rank's, no copy)."""
        return QuantizedBase(self.up.experts(e0, e1), self.down.experts(e0, e1))

    def windowed(self, block_rows: int) -> QuantizedBase:
        """This base dequantising at most m experts at once, m from the row block's rows.

        m = :func:`memfine.config.lora.dequant_window` (``block_rows``, E, d, n, G).
        """
        E, D, G = self.up.shape
        m = dequant_window(block_rows, E, D, self.down.shape[1], G)
        return QuantizedBase(replace(self.up, window=m), replace(self.down, window=m))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_up, w_down) as the fused Function reads them (:meth:`NF4Experts.as_weight`)."""
        return self.up.as_weight(), self.down.as_weight()

