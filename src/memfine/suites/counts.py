"""``counts`` suite: what one MoE layer's forward + backward would cost a GPU, counted on the CPU.

Per method and phase (``fwd``, ``bwd``, ``full`` = both), under
:class:`memfine.counts.ops_count.OpCounter`: non-view ATen ops (≈ kernel launches), host syncs
by kind, ``torch._grouped_mm`` calls and how many CUDA's CUTLASS fast path would take
(:mod:`memfine.counts.grouped_mm_rules`), ``hbm_bytes`` and roofline floors
``roofline_ms_h100`` / ``roofline_ms_h200`` (:mod:`memfine.counts.roofline`) priced at the real
dims (:func:`dim_map`): models of a GPU, not measurements. Each method runs once untimed, then
once counted: exact integers, no percentiles.

Methods (same weights, input, routing and incoming gradients within a point): ``fused``
(memfine's layer at the counted device's default row blocks, :data:`COUNT_GPU`'s for
``--count-device cuda``), ``fused_one_block``, ``fused_512mib``
(:data:`memfine.config.CUDA_BACKWARD_BLOCK_BYTES` blocks: what smaller blocks cost),
``chunked_c4`` (c = 4, per-chunk recompute), ``mact`` (a budget of half the received rows per
chunk), ``torchtitan_style`` (the same router and aux losses, then torchtitan's expert recipe,
:mod:`memfine.baselines.titan_style`; the ``÷ ref`` reference), ``torchtitan`` (its own
``RoutedExperts``, skipped with a line where torchtitan cannot be imported), ``grouped_mm``
(memfine's plain path), ``hf_grouped_mm`` and ``hf_memfine`` (transformers'
``Qwen3MoeExperts`` with its ``grouped_mm`` experts and through memfine's backend; experts only).

The path counted is ``--count-device``'s (``cuda``, the default: an H200's default row blocks
and the ``index_put_`` combine; ``cpu``: the CPU's default blocks and ``index_add_``). Presets
(:data:`PRESETS`, :data:`PRESET_TOKENS`): Qwen3-30B-A3B at T 4096 and 16384, DeepSeek-V3 at
T 4096 (``--tokens``, ``--num-experts``, ``--top-k`` override). d and n are divided by
:data:`DIM_SCALE`: op and sync counts depend on them only through the block count, which is
kept at the real dims' (and through which experts get rows: all of them at these T). Counts
are in bfloat16 (``--dtype`` is refused with this suite alone). docs/gpu.md has the tables.

Legend: T tokens, D = d, K = k.
Reference: docs/design.md §8 (counting on CPU); MoEBlaze §4; torchtitan ``GroupedExperts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from memfine.baselines.layers import (
    base_layer,
    half_rows_budget,
    layer_inputs,
    layer_method,
    sharing,
)
from memfine.baselines.titan_style import (
    titan_style_layer,
    torchtitan_layer,
    torchtitan_missing,
)
from memfine.bench.harness import Method
from memfine.bench.options import BenchOptions, LayerShape, Point
from memfine.bench.results import csv_row
from memfine.config import (
    CUDA_BACKWARD_BLOCK_BYTES,
    DEFAULT_BACKWARD_BLOCK_BYTES,
    ChunkConfig,
    MoEConfig,
    backward_block_rows,
    default_block_bytes,
)
from memfine.counts.ops_count import SYNC_KINDS, OpCounter, PhaseCounts
from memfine.counts.roofline import GPUS
from memfine.environment import Environment
from memfine.experts.device_path import device_path
from memfine.suites import hf
from memfine.suites.experts import moe_config

NAME = "counts"
METHODS = ("fused", "fused_one_block", "fused_512mib", "chunked_c4", "mact", "torchtitan_style",
           "torchtitan", "grouped_mm", "hf_grouped_mm", "hf_memfine")
REFERENCE = "torchtitan_style"
DIM_SCALE = 16
"""d and n are divided by this; the backward block count is kept at the real dims' value."""
PRESETS = {
    "qwen3-30b-a3b": LayerShape(name="qwen3-30b-a3b", tokens=4096, hidden_size=2048,
                                intermediate_size=768, num_experts=128, top_k=8),
    "deepseek-v3": LayerShape(name="deepseek-v3", tokens=4096, hidden_size=7168,
                              intermediate_size=2048, num_experts=256, top_k=8),
}
PRESET_TOKENS = {"qwen3-30b-a3b": (4096, 16384), "deepseek-v3": (4096,)}
"""The T of each preset's points when ``--tokens`` is not given."""
MAX_TOKENS = 65_536
"""The largest ``--tokens`` counted: T·k rows are held on the CPU (at d/16, n/16)."""
COUNT_GPU = "h200"
"""The GPU whose memory sets the default row blocks counted for ``--count-device cuda``."""
BLOCK_BYTES = {"cuda": default_block_bytes("cuda", GPUS[COUNT_GPU].memory_bytes),
               "cpu": DEFAULT_BACKWARD_BLOCK_BYTES}
"""Each counted device's default ``backward_block_bytes``."""
QUICK_TOKENS = 256
DTYPE = torch.bfloat16
ONE_BLOCK_BYTES = 2**62
MODES = {"fwd": ("forward",), "bwd": ("backward",), "full": ("forward", "backward")}


def scaled(shape: LayerShape, dim_scale: int = DIM_SCALE) -> LayerShape:
    """``shape`` with d and n divided by ``dim_scale``, as multiples of 8 (at least 16 and 8).

    The counted d, n and 2n are moved up by 8 until they differ from each other and from T,
    T·k, E, E + 1 and k, so that :func:`dim_map` can read every tensor dim back as real.
    """
    if dim_scale == 1:
        return shape
    T, E, K = shape.tokens, shape.num_experts, shape.top_k
    taken = {T, T * K, E, E + 1, K}
    d = max(16, shape.hidden_size // dim_scale // 8 * 8)
    while d in taken:
        d += 8
    n = max(8, shape.intermediate_size // dim_scale // 8 * 8)
    while {n, 2 * n} & (taken | {d}):
        n += 8
    return dataclasses.replace(shape, hidden_size=d, intermediate_size=n)


def dim_map(real: LayerShape, counted: LayerShape) -> dict[int, int]:
    """Counted size → real size of d, n and 2n (the traffic of a counted stream at real dims)."""
    if counted.hidden_size == real.hidden_size:
        return {}
    n, m = counted.intermediate_size, real.intermediate_size
    return {counted.hidden_size: real.hidden_size, n: m, 2 * n: 2 * m}


def check_tokens(tokens: int, top_k: int) -> None:
    """Raise a usage error unless T fits the suite.

    Raises:
        ValueError: T below k or above :data:`MAX_TOKENS`.
    """
    if not top_k <= tokens <= MAX_TOKENS:
        raise ValueError(f"--tokens must be an int in [{top_k}, {MAX_TOKENS}] for the counts "
                         f"suite (T·k rows are held on the CPU), got {tokens}")


def block_bytes_keeping_rows(real: LayerShape, counted: LayerShape,
                             block_bytes: int = CUDA_BACKWARD_BLOCK_BYTES) -> int:
    """The ``backward_block_bytes`` that gives ``counted`` the block rows ``real`` has.

    Rows per block are ⌊block bytes / row bytes⌋ with row bytes (3·d + 3·n + G)·D_t
    (:func:`memfine.config.backward_block_rows`); the result is ``real``'s rows times
    ``counted``'s row bytes.

    Raises:
        ValueError: if the rows do not come out equal (the block sizing rule changed).
    """
    dt = torch.empty((), dtype=DTYPE).element_size()

    def rows(shape: LayerShape, block: int) -> int:
        n = shape.intermediate_size
        return backward_block_rows(block, shape.hidden_size, n, 2 * n, dt)

    d, n = counted.hidden_size, counted.intermediate_size
    block = rows(real, block_bytes) * (3 * d + 3 * n + 2 * n) * dt
    if rows(counted, block) != rows(real, block_bytes):
        raise ValueError("backward block rows are no longer (3d + 3n + G)·D_t bytes each; "
                         "update block_bytes_keeping_rows")
    return block


@dataclasses.dataclass(frozen=True)
class Counted:
    """One method's counts: the :class:`OpCounter` phases and extras (``num_chunks``)."""

    name: str
    counts: dict[str, PhaseCounts]
    num_chunks: int | None = None
    error: str | None = None

    def phase(self, mode: str) -> PhaseCounts:
        """Counts of ``fwd``, ``bwd`` or ``full`` (forward + backward)."""
        parts = [self.counts[p] for p in MODES[mode]]
        return parts[0] if len(parts) == 1 else parts[0].merged(parts[1])


def count_method(method: Method, *, warmup: bool = True,
                 dims: dict[int, int] | None = None) -> Counted:
    """Count one forward + backward of ``method`` under an :class:`OpCounter`.

    Args:
        method: the method (its ``zero_grad`` runs before each call).
        warmup: run one uncounted call first (lazy set-up stays out of the counts).
        dims: the counter's ``dim_map`` (counted size → real size of the traffic).
    """
    if warmup:
        method.zero_grad()
        method.backward(method.forward())
    method.zero_grad()
    with OpCounter(dim_map=dims) as counter:
        method.backward(method.forward())
    extras = dict(method.extras()) if method.extras is not None else {}
    chunks = extras.get("num_chunks", (None, ""))[0]
    return Counted(name=method.name, counts=counter.counts,
                   num_chunks=chunks if isinstance(chunks, int) else None)


def layer_methods(shape: LayerShape, names: tuple[str, ...], *, block_bytes: int, seed: int = 0,
                  device: torch.device | None = None,
                  small_block_bytes: int = CUDA_BACKWARD_BLOCK_BYTES) -> list[Method]:
    """The selected methods of one (counted) shape that run a whole layer or HF experts.

    ``block_bytes``: the ``fused`` method's row blocks; ``small_block_bytes``:
    ``fused_512mib``'s.
    """
    device = device or torch.device("cpu")
    moe = dataclasses.replace(moe_config(shape), backward_block_bytes=block_bytes)
    base = base_layer(moe, dtype=DTYPE, device=device, seed=seed)
    x_TD, grad_TD = layer_inputs(shape, dtype=DTYPE, device=device, seed=seed)
    budget = half_rows_budget(moe, shape.tokens, x_TD.element_size())
    one_block = dataclasses.replace(moe, backward_block_bytes=ONE_BLOCK_BYTES)
    gmm: MoEConfig = dataclasses.replace(moe, experts_impl="plain", gemm_backend="grouped_mm")
    configs: dict[str, tuple[MoEConfig, ChunkConfig | None]] = {
        "fused": (moe, None), "fused_one_block": (one_block, None),
        "fused_512mib": (dataclasses.replace(moe, backward_block_bytes=small_block_bytes), None),
        "chunked_c4": (moe, ChunkConfig(num_chunks=4, recompute="experts")),
        "mact": (moe, ChunkConfig(memory_budget_bytes=budget, recompute="experts")),
        "grouped_mm": (gmm, None)}
    layers = {n: sharing(base, cfg, chunk=chunk) for n, (cfg, chunk) in configs.items()
              if n in names}
    if "torchtitan_style" in names:
        layers["torchtitan_style"] = titan_style_layer(base, moe)
    if "torchtitan" in names and torchtitan_missing() is None:
        layers["torchtitan"] = torchtitan_layer(base, moe)
    methods = [layer_method(n, layers[n], x_TD, grad_TD, modelled=False)
               for n in names if n in layers]
    hf_names = tuple(n for n in names if n.startswith("hf_"))
    if hf_names and hf.available():
        methods += hf_methods(shape, hf_names, seed=seed, device=device)
    return methods


def hf_methods(shape: LayerShape, names: tuple[str, ...], *, seed: int,
               device: torch.device) -> list[Method]:
    """``hf_grouped_mm`` and ``hf_memfine`` on one bf16 ``Qwen3MoeExperts`` (hf suite helpers)."""
    opts = BenchOptions(suites=("hf",), dtype="bfloat16", seed=seed)
    experts = hf.make_experts(shape, opts, device)
    hf_name = {"hf_grouped_mm": "hf_grouped_mm", "hf_memfine": "memfine"}
    methods = hf.build_methods(experts, hf.make_inputs(shape, opts, device),
                               tuple(hf_name[n] for n in names))
    ours = {v: k for k, v in hf_name.items()}
    return [dataclasses.replace(m, name=ours[m.name]) for m in methods]


def count_shape(real: LayerShape, names: tuple[str, ...], *, dim_scale: int = DIM_SCALE,
                seed: int = 0, warmup: bool = True, device: str = "cuda"
                ) -> tuple[LayerShape, int, list[Counted]]:
    """Count every selected method at ``real`` with d and n divided by ``dim_scale``.

    ``warmup``: as in :func:`count_method`. ``device``: whose path and default row blocks are
    counted (:func:`device_path`, :data:`BLOCK_BYTES`). Bytes and FLOPs are priced at the real
    dims (:func:`dim_map`).

    Returns:
        (the counted shape, its ``backward_block_bytes``, one :class:`Counted` per method).
    """
    shape = scaled(real, dim_scale)
    block = block_bytes_keeping_rows(real, shape, BLOCK_BYTES[device])
    small = block_bytes_keeping_rows(real, shape, CUDA_BACKWARD_BLOCK_BYTES)
    dims = dim_map(real, shape)
    results = []
    for method in layer_methods(shape, names, block_bytes=block, seed=seed,
                                small_block_bytes=small):
        try:
            with device_path(device, block):
                results.append(count_method(method, warmup=warmup, dims=dims))
        except (RuntimeError, ValueError) as err:
            results.append(Counted(name=method.name, counts={}, error=f"{type(err).__name__}: "
                                   f"{err}"))
    return shape, block, results


def csv_rows(point: Point, env: Environment) -> list[dict[str, str]]:
    """CSV rows (the shared schema) of one point: method × mode × metric, exact counts."""
    rows = []
    for res in point.results:
        if res.error is not None:
            continue
        for mode in MODES:
            c = res.phase(mode)
            calls = c.grouped_mm
            metrics: list[tuple[str, str, float | None]] = [
                ("non_view_ops", "ops", c.non_view_ops), ("view_ops", "ops", c.view_ops),
                ("host_syncs", "syncs", c.host_syncs),
                *((f"syncs_{k}", "syncs", c.syncs[k]) for k in SYNC_KINDS),
                ("grouped_mm_calls", "calls", len(calls)),
                ("grouped_mm_cuda_fast_path_calls", "calls", sum(g.fast_path for g in calls)),
                ("grouped_mm_calls_with_empty_groups", "calls",
                 sum(bool(g.empty_groups) for g in calls)),
                ("num_chunks", "chunks", res.num_chunks), ("hbm_bytes", "bytes", c.hbm_bytes),
                *((f"roofline_ms_{gpu}", "ms", round(c.roofline_ms(gpu), 4)) for gpu in GPUS)]
            rows += [csv_row(benchmark=point.suite, method=res.name, mode=mode, metric=metric,
                             unit=unit, x_name=point.x_name, x_value=point.x_value,
                             values=value, config=point.config, env=env)
                     for metric, unit, value in metrics]
    return rows


def print_point(point: Point) -> None:
    """One line per method: ops, syncs and fast-path ``_grouped_mm`` calls, fwd / bwd."""
    print(f"[{NAME}] {point.label}")
    print(f"{'method':<16} {'ops fwd':>8} {'ops bwd':>8} {'÷ ref':>6} {'syncs':>6} "
          f"{'gmm':>5} {'fast':>5} {'HBM GB':>7} {'H200 ms':>8}  sync kinds")
    ref = next((r for r in point.results if r.name == point.reference and r.error is None), None)
    for res in point.results:
        if res.error is not None:
            print(f"{res.name:<16} failed: {res.error[:100]}")
            continue
        fwd, bwd, full = (res.phase(m) for m in MODES)
        ratio = (f"{full.non_view_ops / ref.phase('full').non_view_ops:.2f}"
                 if ref is not None else "-")
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(full.syncs.items()) if n)
        print(f"{res.name:<16} {fwd.non_view_ops:>8} {bwd.non_view_ops:>8} {ratio:>6} "
              f"{full.host_syncs:>6} {len(full.grouped_mm):>5} "
              f"{sum(g.fast_path for g in full.grouped_mm):>5} {full.hbm_bytes / 1e9:>7.2f} "
              f"{full.roofline_ms('h200'):>8.2f}  {kinds}".rstrip())


def shapes(opts: BenchOptions) -> list[LayerShape]:
    """The points: each preset at its :data:`PRESET_TOKENS` or at ``--tokens``.

    Resolved by the runner before its first line. ``--quick``: T = 256; ``--num-experts`` and
    ``--top-k`` applied.

    Raises:
        ValueError: a ``--tokens`` outside [k, :data:`MAX_TOKENS`] (:func:`check_tokens`), or
            k above E.
    """
    tokens = opts.tokens or (QUICK_TOKENS if opts.quick else None)
    points = []
    for name, shape in PRESETS.items():
        for T in PRESET_TOKENS[name] if tokens is None else (tokens,):
            E = shape.num_experts if opts.num_experts is None else opts.num_experts
            K = shape.top_k if opts.top_k is None else opts.top_k
            if K > E:
                raise ValueError(f"--top-k must be at most --num-experts: the {name} preset "
                                 f"would have k {K} and E {E}")
            check_tokens(T, K)
            points.append(dataclasses.replace(shape, tokens=T, num_experts=E, top_k=K))
    return points


def run(opts: BenchOptions, device: torch.device, names: tuple[str, ...]) -> Iterator[Point]:
    """Run the suite on the CPU: one point per preset (none, with a message, on another device).

    The counts are of what a GPU would run, counted where running is cheap.
    """
    if device.type != "cpu":
        print(f"{NAME}: skipped: counts run on the CPU (got --device {device.type})")
        return
    if "torchtitan" in names and torchtitan_missing() is not None:
        print(f"{NAME}: torchtitan skipped: {torchtitan_missing()}")
    for real in shapes(opts):
        print(f"[{NAME}] {real.label()}: {len(names)} methods x (1 untimed + 1 counted) calls",
              flush=True)
        shape, block, results = count_shape(real, names, seed=opts.seed,
                                            device=opts.count_device)
        config: dict[str, Any] = {
            **real.to_dict(), "dtype": "bfloat16", "dim_scale": DIM_SCALE,
            "count_device": opts.count_device,
            "default_backward_block_bytes": BLOCK_BYTES[opts.count_device],
            "count_gpu_memory_bytes": (GPUS[COUNT_GPU].memory_bytes
                                       if opts.count_device == "cuda" else None),
            "counted_hidden_size": shape.hidden_size,
            "counted_intermediate_size": shape.intermediate_size,
            "counted_backward_block_bytes": block,
            "roofline_gpus": {g.name: [g.flops_per_s, g.bytes_per_s, g.source, g.memory_bytes]
                              for g in GPUS.values()},
            "note": "counted at about d/dim_scale and n/dim_scale with the real dims' backward "
                    "block rows; op and sync counts do not depend on d and n otherwise; "
                    "hbm_bytes and roofline_ms read every counted d, n, 2n dim as the real one; "
                    "models of a GPU until one measures them"}
        yield Point(suite=NAME, x_name="preset", x_value=f"{real.name}/T{real.tokens}",
                    label=f"{real.label()} bf16, {opts.count_device}'s path (counted at "
                          f"d={shape.hidden_size} n={shape.intermediate_size})",
                    config=config, results=results, reference=REFERENCE)

