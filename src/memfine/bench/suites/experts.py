"""``experts`` suite: one MoE layer (router + experts) forward + backward, six ways.

Methods (same weights, input, routing and incoming gradients):

- ``plain``: what most PyTorch MoE code does — gather the rows into a copy, one matmul per
  expert, scatter back (:func:`memfine.ops.experts_plain` on the ``loop`` backend);
- ``expert_loop``: a Python loop over experts with index masks (transformers ``eager`` style);
- ``grouped_mm``: the same copies with ``torch._grouped_mm`` (torchtitan style);
- ``fused``: memfine's fused expert Function (saves x and H only; MoEBlaze);
- ``fused_mact``: fused, chunked with per-chunk recompute, c chosen by MACT from a byte budget
  (default: the budget that holds half of the received rows per chunk, so c = 2);
- ``full_recompute``: checkpoint around the whole ``grouped_mm`` layer (full activation
  checkpointing, as torchtitan's full AC does).

With ``--compile``: ``fused_compiled`` and ``fused_mact_compiled``, the same layers under
``torch.compile`` (inductor by default; MACT's decision is the one graph break), peak bytes
measured with ``torch.profiler`` and not modelled.

Shapes: MoEBlaze Table 1 rows 1, 2, 3, 5 (d ≤ 1024) with batch × seq / 256 by default.
Legend: T tokens, D = d.
Reference: MoEBlaze §5 and Table 1; MemFine §4; docs/design.md §3, §5, §7.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from memfine.bench.harness import Method
from memfine.bench.options import COMPILED_SUFFIX, BenchOptions, LayerShape, Point
from memfine.bench.suites.layers import (
    CheckpointedLayer,
    ExpertLoopMoELayer,
    ShapeRun,
    base_layer,
    compiled_layer_method,
    half_rows_budget,
    layer_inputs,
    layer_method,
    shape_points,
    sharing,
)
from memfine.config import ChunkConfig, MoEConfig
from memfine.nn import MoELayer
from memfine.units import format_bytes

NAME = "experts"
METHODS = ("plain", "expert_loop", "grouped_mm", "fused", "fused_mact", "full_recompute")
COMPILABLE = ("fused", "fused_mact")
REFERENCE = "fused"
DEFAULT_CONFS = (1, 2, 3, 5)
QUICK = LayerShape(name="quick", tokens=64, hidden_size=64, intermediate_size=128,
                   num_experts=4, top_k=2)


def moe_config(shape: LayerShape, **overrides: object) -> MoEConfig:
    """SwiGLU MoE config of a shape (renormalised top-k weights when k > 1)."""
    return MoEConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                     num_experts=shape.num_experts, top_k=shape.top_k,
                     renormalize=shape.top_k > 1, **overrides)  # type: ignore[arg-type]


def build_methods(shape: LayerShape, opts: BenchOptions, device: torch.device,
                  names: tuple[str, ...]) -> tuple[list[Method], int]:
    """The selected methods of one shape, and the MACT budget in bytes."""
    moe = moe_config(shape)
    dtype = opts.torch_dtype
    base = base_layer(moe, dtype=dtype, device=device, seed=opts.seed)
    x_TD, grad_TD = layer_inputs(shape, dtype=dtype, device=device, seed=opts.seed)
    dt = x_TD.element_size()
    budget = opts.budget_bytes or half_rows_budget(moe, shape.tokens, dt)
    plain_loop = dataclasses.replace(moe, experts_impl="plain", gemm_backend="loop")
    plain_gmm = dataclasses.replace(moe, experts_impl="plain", gemm_backend="grouped_mm")
    mact = ChunkConfig(memory_budget_bytes=budget, recompute="experts")
    layers: dict[str, Callable[[], MoELayer]] = {
        "fused": lambda: sharing(base, moe), "fused_mact": lambda: sharing(base, moe, chunk=mact)}
    budgets = {"fused_mact": budget}
    builders: dict[str, Callable[[], Method]] = {
        "plain": lambda: layer_method("plain", sharing(base, plain_loop), x_TD, grad_TD),
        "expert_loop": lambda: layer_method(
            "expert_loop", sharing(base, moe, cls=ExpertLoopMoELayer), x_TD, grad_TD,
            modelled=False),
        "grouped_mm": lambda: layer_method("grouped_mm", sharing(base, plain_gmm), x_TD, grad_TD),
        "fused": lambda: layer_method("fused", layers["fused"](), x_TD, grad_TD),
        "fused_mact": lambda: layer_method("fused_mact", layers["fused_mact"](), x_TD,
                                           grad_TD, budget_bytes=budget),
        "full_recompute": lambda: layer_method(
            "full_recompute", CheckpointedLayer(sharing(base, plain_gmm)), x_TD, grad_TD,
            modelled=False),
    }

    def compiled_method(name: str) -> Method:
        eager = name.removesuffix(COMPILED_SUFFIX)
        return compiled_layer_method(name, layers[eager](), x_TD, grad_TD, opts.compile_backend,
                                     budgets.get(eager))

    # A method listed in METHODS/COMPILABLE without a builder here is refused with its name.
    missing = sorted((set(METHODS) - set(builders)) | (set(COMPILABLE) - set(layers)))
    unknown = [n for n in names
               if n not in builders and n.removesuffix(COMPILED_SUFFIX) not in layers]
    if missing or unknown:
        raise ValueError(f"bench suite {NAME!r}: method(s) {missing or unknown} have no builder "
                         "in memfine.bench.suites.experts.build_methods (a method is listed in "
                         "METHODS and built there)")
    return [builders[n]() if n in builders else compiled_method(n) for n in names], budget


def run(opts: BenchOptions, device: torch.device, names: tuple[str, ...]
        ) -> Iterator[Point]:
    """Run the suite: one point per shape."""

    def build(shape: LayerShape) -> ShapeRun:
        methods, budget = build_methods(shape, opts, device, names)
        return (methods, {"activation": "swiglu", "budget_bytes": budget},
                f"{shape.label()} {opts.dtype}; MACT budget {format_bytes(budget)}",
                {"fused_mact": budget})

    yield from shape_points(NAME, opts, device, names, confs=DEFAULT_CONFS, quick=QUICK,
                            reference=REFERENCE, build=build)
