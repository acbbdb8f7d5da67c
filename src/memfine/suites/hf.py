"""``hf`` suite: transformers' experts blocks (Qwen3-MoE, GPT-OSS) through the experts interface.

Needs transformers (``pip install 'memfine[hf]'``); skipped without it. Per shape, one
``Qwen3MoeExperts`` (SwiGLU, no bias; points ``<shape>``) and one ``GptOssExperts`` (biases,
clamped interleaved SwiGLU with α = 1.702 and limit 7; points ``<shape>-gpt_oss``), with
N(0, 0.02²) weights and biases, are called with each implementation on the same hidden states,
routing (softmax top-k, renormalised; weights require grad as a router's do) and incoming
gradient. Routing is outside the timed region; memfine's index build and transformers' sort are
inside. Saved bytes leave the parameters (biases included) out, so memfine's ratio to the x + H
floor is that of the fused Function's x, H, routing weights and int32 indices for both modules.

Methods: ``hf_eager`` (transformers' per-expert loop), ``hf_grouped_mm`` (its sort +
``torch._grouped_mm`` path, the CPU default; it fails where ``_grouped_mm``'s alignment rules do
not hold), ``memfine`` (``memfine_experts_forward``: the fused path), ``memfine_c4`` (4 token
chunks with per-chunk recompute). The memory model covers memfine's own layer, not this module:
predictions read "not modelled".

Shapes: MoEBlaze Table 1 rows 1 and 5 scaled down (as the ``experts`` suite).
Legend: T tokens, K top-k slots, E experts, D = d.
Reference: docs/design.md §7 (the experts interface); ``benchmarks/bench_hf.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memfine._optional import is_available
from memfine.baselines.layers import ShapeRun, shape_points
from memfine.bench.harness import Method
from memfine.bench.options import BenchOptions, LayerShape, Point
from memfine.suites.experts import QUICK
from memfine.suites.experts import shapes as expert_shapes

NAME = "hf"
METHODS = ("hf_eager", "hf_grouped_mm", "memfine", "memfine_c4")
REFERENCE = "memfine"
DEFAULT_CONFS = (1, 5)


def available() -> bool:
    """True when transformers can be imported."""
    return is_available("transformers")


MODULES = ("qwen3_moe", "gpt_oss")


def make_experts(shape: LayerShape, opts: BenchOptions, device: torch.device,
                 model_type: str = "qwen3_moe") -> Any:
    """A transformers experts module of this shape, seeded N(0, 0.02²) weights (and biases).

    ``model_type`` ``qwen3_moe`` builds ``Qwen3MoeExperts``, ``gpt_oss`` ``GptOssExperts``.
    """
    import transformers

    torch.manual_seed(opts.seed)
    experts: nn.Module
    if model_type == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        experts = GptOssExperts(transformers.GptOssConfig(
            hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
            num_local_experts=shape.num_experts, num_experts_per_tok=shape.top_k))
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        experts = Qwen3MoeExperts(transformers.Qwen3MoeConfig(
            hidden_size=shape.hidden_size, moe_intermediate_size=shape.intermediate_size,
            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.02)
    return experts.to(device=device, dtype=opts.torch_dtype)


def make_inputs(shape: LayerShape, opts: BenchOptions, device: torch.device
                ) -> dict[str, torch.Tensor]:
    """Seeded random inputs of one experts call: hidden states, routing and output gradient.

    Hidden states x (T, d), a renormalised softmax top-k routing (index (T, k) int64,
    weights (T, k)) and the incoming gradient (T, d); x and the weights require grad.
    """
    gen = torch.Generator().manual_seed(opts.seed + 1)
    T, D, E, K = shape.tokens, shape.hidden_size, shape.num_experts, shape.top_k
    x_TD = torch.randn(T, D, generator=gen)
    weights_TK, index_TK = torch.randn(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    grad_TD = torch.randn(T, D, generator=gen)
    dtype = opts.torch_dtype
    return {"x": x_TD.to(device, dtype).requires_grad_(True), "index": index_TK.to(device),
            "weights": weights_TK.to(device, dtype).requires_grad_(True),
            "grad": grad_TD.to(device, dtype)}


def build_methods(experts: Any, inp: dict[str, torch.Tensor], names: tuple[str, ...]
                  ) -> list[Method]:
    """The selected methods on one experts module."""
    from memfine.integrations.transformers import make_config, memfine_experts_forward

    def hf(impl: str) -> Any:
        def call() -> torch.Tensor:
            experts.config._experts_implementation = impl
            out: torch.Tensor = experts(inp["x"], inp["index"], inp["weights"])
            return out
        return call

    def memfine(num_chunks: int | None) -> Any:
        config = make_config(num_chunks=num_chunks)
        return lambda: memfine_experts_forward(experts, inp["x"], inp["index"], inp["weights"],
                                               config=config)

    calls = {"hf_eager": hf("eager"), "hf_grouped_mm": hf("grouped_mm"),
             "memfine": memfine(None), "memfine_c4": memfine(4)}

    def zero_grad() -> None:
        for t in [*experts.parameters(), inp["x"], inp["weights"]]:
            t.grad = None

    return [Method(name=name, forward=calls[name],
                   backward=lambda out: out.backward(inp["grad"]), zero_grad=zero_grad,
                   tokens=inp["x"].shape[0]) for name in names]


def shapes(opts: BenchOptions) -> list[LayerShape]:
    """The suite's shapes (:func:`memfine.suites.experts.shapes` of its default rows)."""
    return expert_shapes(opts, DEFAULT_CONFS)


def run(opts: BenchOptions, device: torch.device, names: tuple[str, ...]
        ) -> Iterator[Point]:
    """Run the suite (no points, with a message, when transformers is missing)."""
    if not available():
        print("hf: skipped: transformers is not installed (pip install 'memfine[hf]')")
        return

    def builder(model_type: str) -> Callable[[LayerShape], ShapeRun]:
        def build(shape: LayerShape) -> ShapeRun:
            experts = make_experts(shape, opts, device, model_type)
            methods = build_methods(experts, make_inputs(shape, opts, device), names)
            module = type(experts).__name__
            return (methods, {"module": module},
                    f"transformers {module}, {shape.label()} {opts.dtype}", {})
        return build

    for model_type in MODULES:
        yield from shape_points(NAME, opts, device, names, confs=DEFAULT_CONFS, quick=QUICK,
                                reference=REFERENCE, build=builder(model_type),
                                variant="" if model_type == "qwen3_moe" else model_type)
