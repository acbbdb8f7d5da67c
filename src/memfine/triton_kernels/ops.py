"""Launchers of the Triton expert kernels, registered as ``torch.library`` custom ops.

Legend: S routed rows, T tokens, K top-k slots, E experts, I input / O output features,
D = d, N = n, G = 2n (gated) or n.
Each op has a fake impl (output shapes only), so FakeTensorMode, meta estimates and
``torch.compile`` see through it. Kernels run on CUDA tensors, or on CPU tensors under the Triton
interpreter (``TRITON_INTERPRET=1`` set before the first launch), where tiles are small and
operands are upcast to fp32. The kernel module is imported on the first launch.
Reference: MoEBlaze §4; docs/style.md §9 (launchers as custom ops with fake impls).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from memfine._optional import require

_ACT = {"silu": 0, "gelu": 1, "relu": 2, "swiglu": 0, "geglu": 1}
_GATED = ("swiglu", "geglu")
GPU_BLOCK_M = 64
"""Rows per tile on CUDA, every config: the tile schedule (:func:`tile_schedule`) is built for
it before the launch, so the autotuner varies the other block sizes."""
GPU_CONFIGS: tuple[dict[str, int], ...] = (
    {"BN": 64, "BK": 32, "num_warps": 4, "num_stages": 3},
    {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4},
    {"BN": 128, "BK": 32, "num_warps": 4, "num_stages": 4},
    {"BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3},
    {"BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
    {"BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3},
)
"""Autotune configs of the grouped GEMM and gather-up kernels on CUDA (BM = GPU_BLOCK_M): output
columns BN, K step BK, warps, and software-pipelined K stages. Their shared memory and stages per
architecture, compiled ahead of time on the CPU: benchmarks/results/triton_configs_aot.csv
(``benchmarks/triton_configs.py``); a config over a device's shared memory is dropped by the
autotuner when it fails to launch."""
_CPU_TILE = {"BM": 16, "BN": 16, "BK": 16}  # interpreter: tl.dot needs every block dim ≥ 16
_TUNE_KEYS = {"_grouped_gemm_kernel": ["in_features", "out_features", "GATHER", "SCALE", "IEEE"],
              "_gather_up_kernel": ["in_features", "N", "GATED", "ACT", "IEEE"]}


def _kernels(device: torch.device) -> ModuleType:
    triton = require("triton")
    if device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set "
                           "before the first launch to run kernels on CPU (slow; for tests)")
    from memfine.triton_kernels import kernels

    return kernels


@functools.cache
def _tuned(name: str) -> Any:
    """The kernel ``name`` under ``triton.autotune`` over :data:`GPU_CONFIGS` (CUDA only)."""
    triton = require("triton")
    from memfine.triton_kernels import kernels

    configs = [triton.Config({"BM": GPU_BLOCK_M, "BN": c["BN"], "BK": c["BK"]},
                             num_warps=c["num_warps"], num_stages=c["num_stages"])
               for c in GPU_CONFIGS]
    return triton.autotune(configs=configs, key=_TUNE_KEYS[name])(getattr(kernels, name))


def _launch(name: str, device: torch.device, num_tiles: int, cols: int,
            *args: Any, **flags: Any) -> None:
    """Launch kernel ``name``: autotuned on CUDA, the interpreter's small tiles on the CPU.

    The grid is (``num_tiles`` row tiles of the schedule, ⌈cols / BN⌉ column tiles).
    """
    if device.type == "cpu":
        grid = (num_tiles, -(-cols // _CPU_TILE["BN"]))
        getattr(_kernels(device), name)[grid](*args, **flags, **_CPU_TILE)
        return
    _tuned(name)[lambda meta: (num_tiles, -(-cols // meta["BN"]))](*args, **flags)


def _block_rows(device: torch.device) -> int:
    return _CPU_TILE["BM"] if device.type == "cpu" else GPU_BLOCK_M


def _precision(x: torch.Tensor, in_features: int) -> dict[str, int]:
    interpreted = x.device.type == "cpu"  # the interpreter (kernels module docstring)
    return {"UPCAST": interpreted, "IEEE": x.dtype == torch.float32,
            "K_FIXED": in_features if interpreted else 0}


def tile_schedule(offsets_E1: torch.Tensor, block_rows: int, num_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row tiles that never span two experts, on a grid sized from shapes alone (no host sync).

    Expert e needs ceil(c_e / BM) tiles; over all experts that is at most
    ``ceil(S / BM) + min(E, S)``, the fixed tile count returned. Tiles past the experts' own are
    idle: they name the last expert and start at its end, so a kernel masks all their rows and
    skips their K loop. Everything is computed on the offsets' device; no value is read back.

    Args:
        offsets_E1: (E + 1,) int32 expert_token_offsets.
        block_rows: rows per tile (BM).
        num_rows: S, the grouped rows (a shape, known on the host); ``offsets_E1[E] <= S``.

    Returns:
        ``(tile_expert, tile_start)``: (ceil(S / BM) + min(E, S),) int32 expert and first row of
        every tile; the experts' tiles first, in expert order, then the idle ones.
    """
    offsets = offsets_E1.long()
    E = offsets.numel() - 1
    num_tiles = -(-num_rows // block_rows) + min(E, num_rows) if E > 0 else 0
    tile = torch.arange(num_tiles, device=offsets.device)
    if num_tiles == 0:
        return tile.int(), tile.int()
    tiles_E = (offsets.diff() + block_rows - 1) // block_rows
    end_tile_E = tiles_E.cumsum(0)
    owner = torch.searchsorted(end_tile_E, tile, right=True)  # E for an idle tile
    expert = owner.clamp(max=E - 1)
    rank = tile - (end_tile_E[expert] - tiles_E[expert])
    tile_start = torch.where(owner < E, offsets[expert] + rank * block_rows,
                             offsets[expert + 1])
    return expert.int(), tile_start.int()


def _gemm(x: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor, out_SO: torch.Tensor,
          rows_S: torch.Tensor | None, scale_S: torch.Tensor | None) -> torch.Tensor:
    _kernels(x.device)
    in_features, out_features = w_EIO.shape[1], w_EIO.shape[2]
    tile_expert, tile_start = tile_schedule(offsets_E1, _block_rows(x.device), out_SO.shape[0])
    if tile_expert.numel() and out_features:
        _launch("_grouped_gemm_kernel", x.device, tile_expert.numel(), out_features,
                x, w_EIO, out_SO, rows_S if rows_S is not None else offsets_E1,
                scale_S if scale_S is not None else x, tile_expert, tile_start, offsets_E1,
                in_features, out_features, x.stride(0), x.stride(1), *w_EIO.stride(),
                *out_SO.stride(), GATHER=rows_S is not None, SCALE=scale_S is not None,
                **_precision(x, in_features))
    return out_SO


@torch.library.custom_op("memfine::triton_grouped_mm", mutates_args=())
def grouped_mm(x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor
               ) -> torch.Tensor:
    """Y[rows of e] = X[rows of e] · W[e] (any strides; fp32/bf16/fp16).

    Args:
        x_SI: (S, I) grouped rows (the rows of expert e are contiguous).
        w_EIO: (E, I, O) per-expert weights.
        offsets_E1: (E + 1,) int32 expert_token_offsets (expert e owns rows [off[e], off[e+1])).

    Returns:
        (S, O) new tensor in x's dtype.
    """
    out_SO = x_SI.new_empty(x_SI.shape[0], w_EIO.shape[-1])
    return _gemm(x_SI, w_EIO, offsets_E1, out_SO, None, None)


@grouped_mm.register_fake
def _(x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    return x_SI.new_empty(x_SI.shape[0], w_EIO.shape[-1])


@torch.library.custom_op("memfine::triton_gather_up", mutates_args=())
def gather_up(x_TD: torch.Tensor, w_up_EDG: torch.Tensor, expert_token_indices_S: torch.Tensor,
              offsets_E1: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """H = x[expert_token_indices] · w_up[e] with the activation in the epilogue.

    Args:
        x_TD: (T, d) token-order input (rows are gathered inside the kernel: no (S, d) copy).
        w_up_EDG: (E, d, G) with [gate | up] halves for gated activations.
        expert_token_indices_S: (S,) int32 token id of each routed row.
        offsets_E1: (E + 1,) int32 expert_token_offsets.
        activation: ``swiglu``, ``geglu``, ``silu``, ``gelu`` or ``relu``.

    Returns:
        ``(h_SG, a_SN)`` new tensors in x's dtype: H (to save) and A = act(H) (transient).
    """
    _kernels(x_TD.device)
    S, (_, D, G) = expert_token_indices_S.shape[0], w_up_EDG.shape
    gated = activation in _GATED
    N = G // 2 if gated else G
    h_SG, a_SN = x_TD.new_empty(S, G), x_TD.new_empty(S, N)
    tile_expert, tile_start = tile_schedule(offsets_E1, _block_rows(x_TD.device), S)
    if tile_expert.numel() and N:
        _launch("_gather_up_kernel", x_TD.device, tile_expert.numel(), N,
                x_TD, w_up_EDG, h_SG, a_SN, expert_token_indices_S, tile_expert, tile_start,
                offsets_E1, D, N, x_TD.stride(0), x_TD.stride(1), *w_up_EDG.stride(),
                *h_SG.stride(), *a_SN.stride(), GATED=gated, ACT=_ACT[activation],
                **_precision(x_TD, D))
    return h_SG, a_SN


@gather_up.register_fake
def _(x_TD: torch.Tensor, w_up_EDG: torch.Tensor, expert_token_indices_S: torch.Tensor,
      offsets_E1: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    S, G = expert_token_indices_S.shape[0], w_up_EDG.shape[-1]
    return x_TD.new_empty(S, G), x_TD.new_empty(S, G // 2 if activation in _GATED else G)


def _combine(rows_SD: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(rows_SD.device)
    (T, K), D = token_index_map_TK.shape, rows_SD.shape[1]
    out_TD = rows_SD.new_empty(T, D)
    block = 16 if rows_SD.device.type == "cpu" else 64
    if T and D:
        grid = (-(-T // block), -(-D // block))
        kernels._combine_kernel[grid](rows_SD, token_index_map_TK, out_TD, T, D, K,
                                      *rows_SD.stride(), *token_index_map_TK.stride(),
                                      *out_TD.stride(), BT=block, BD=block)
    return out_TD


@torch.library.custom_op("memfine::triton_down_combine", mutates_args=())
def down_combine(a_SN: torch.Tensor, w_down_END: torch.Tensor, offsets_E1: torch.Tensor,
                 row_weights_S: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j w_r · (A[r] · w_down[e_r]) with r = token_index_map[t, j] (valid slots).

    The down-projection scales each row by its routing weight in the epilogue; a per-token
    kernel then sums the k rows of every token in slot order (deterministic, no atomics).

    Args:
        a_SN: (S, n) activation rows.
        w_down_END: (E, n, d) down-projection weights.
        offsets_E1: (E + 1,) int32 expert_token_offsets.
        row_weights_S: (S,) routing weight of each row.
        token_index_map_TK: (T, k) int32 row of each slot, -1 for a sentinel slot.

    Returns:
        (T, d) new tensor in a's dtype.

    Memory: a transient (S, d) buffer of weighted rows.
    """
    y_SD = a_SN.new_empty(a_SN.shape[0], w_down_END.shape[-1])
    _gemm(a_SN, w_down_END, offsets_E1, y_SD, None, row_weights_S)
    return _combine(y_SD, token_index_map_TK)


@down_combine.register_fake
def _(a_SN: torch.Tensor, w_down_END: torch.Tensor, offsets_E1: torch.Tensor,
      row_weights_S: torch.Tensor, token_index_map_TK: torch.Tensor) -> torch.Tensor:
    return a_SN.new_empty(token_index_map_TK.shape[0], w_down_END.shape[-1])
