"""Benchmark methods built on one MoE layer: memfine's paths and the baselines users run today.

Every method of a point shares one set of weights (the same ``nn.Parameter`` objects), the same
input x (T, d) and the same incoming gradients, and follows the memory model's protocol: x exists
before the call and requires grad; the parameters have no ``.grad`` (set to ``None`` before each
call); backward runs from the output, the load-balancing loss and the z-loss with gradients that
exist before (:func:`memfine.memory.layer.moe_layer_memory`).

Baselines written here (not part of memfine's API):

- :func:`expert_loop` and :class:`ExpertLoopMoELayer`: the per-expert Python loop with index
  masks of transformers' ``eager`` experts (gather, two matmuls, weighted ``index_add_``);
- :class:`CheckpointedLayer`: ``torch.utils.checkpoint`` (non-reentrant) around the whole layer,
  router included, as full activation checkpointing of a layer does.

The compiled column (``memfine bench --compile``): :class:`CompiledLayer` calls a layer through
``torch.compile`` (:func:`compiled`); its method measures peak bytes with ``torch.profiler``
(inductor's buffers bypass the live-storage tracker) and is not modelled (the memory model
describes the eager schedule; the compiled graph saves what the partitioner chooses).

Legend: T tokens, R rows of one expert, K top-k slots, E experts, D = d, N = n.
Reference: docs/design.md §5 (memory per scheme), §7 (what users compare with).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfine.activations import apply_activation
from memfine.bench.harness import Extra, Method, run_methods
from memfine.bench.options import (
    COMPILED_SUFFIX,
    BenchOptions,
    LayerShape,
    Point,
    announce,
    resolve_shapes,
    table1_shape,
)
from memfine.config import ChunkConfig, MoEConfig
from memfine.memory import layer as layer_memory
from memfine.nn import GroupedExperts, MoELayer
from memfine.schedule.policy import ChunkPlan, ChunkPolicy
from memfine.units import format_bytes


def expert_loop(x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, activation: str = "swiglu"
                ) -> torch.Tensor:
    """Per expert: rows by mask → up-projection → activation → down-projection → index_add_.

    The per-expert Python loop most PyTorch MoE code writes (transformers ``eager`` style).

    Args:
        x_TD: (T, d) input rows.
        top_k_index: (T, k) int64 expert of each slot.
        top_k_weights: (T, k) routing weights (cast to x's dtype).
        w_up_EDG: (E, d, G) up-projection weights.
        w_down_END: (E, n, d) down-projection weights.
        activation: the expert activation.

    Returns:
        (T, d) new tensor.

    Memory: autograd saves, per expert, the gathered rows, H, the activation's tensors, the
    output rows and the weights (as the plain path, plus the per-expert index tensors).
    """
    weights_TK = top_k_weights.to(x_TD.dtype)
    out_TD = torch.zeros_like(x_TD)
    for e in range(w_up_EDG.shape[0]):
        token_R, slot_R = torch.where(top_k_index == e)
        if token_R.numel() == 0:
            continue
        a_RN = apply_activation(x_TD[token_R] @ w_up_EDG[e], activation)
        y_RD = (a_RN @ w_down_END[e]) * weights_TK[token_R, slot_R, None]
        out_TD.index_add_(0, token_R, y_RD)
    return out_TD


class ExpertLoopExperts(GroupedExperts):
    """Experts run as a Python loop over experts (transformers ``eager`` style)."""

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, ChunkPlan]:
        """:func:`expert_loop` over the expert weights; one chunk (the policy is not asked)."""
        return expert_loop(x_TD, top_k_index, top_k_weights, self.w_up, self.w_down,
                           self.config.activation), ChunkPlan(1)


class ExpertLoopMoELayer(MoELayer):
    """MoE layer whose experts are :class:`ExpertLoopExperts`."""

    def __init__(self, config: MoEConfig, **kwargs: Any) -> None:
        """As :class:`MoELayer`, with the loop experts."""
        super().__init__(config, **kwargs)
        self.experts = ExpertLoopExperts(config)


class CheckpointedLayer(nn.Module):
    """Non-reentrant checkpoint around a whole MoE layer (backward re-runs it, router included).

    Memory: keeps only the layer input for backward; the recompute in backward rebuilds
    everything the wrapped layer saves, so the backward peak is the wrapped layer's.
    """

    def __init__(self, layer: MoELayer) -> None:
        """Wrap ``layer`` (its parameters stay its own)."""
        super().__init__()
        self.layer = layer
        self.config = layer.config

    def forward(self, x: torch.Tensor) -> Any:
        """Same as the wrapped layer: ``(out, aux)``."""
        return checkpoint(self.layer, x, use_reentrant=False, preserve_rng_state=False)


def compiled(module: nn.Module, backend: str) -> Callable[..., Any]:
    """``torch.compile(module, backend=backend)``, called with ``capture_scalar_outputs`` on.

    With ``capture_scalar_outputs`` the routing index's row count S stays in the graph (an
    unbacked size), so the layer compiles whole except MACT's decision (docs/compile.md).

    Args:
        module: the module to compile (its parameters are shared, not copied).
        backend: a ``torch.compile`` backend (``inductor``, ``aot_eager``).

    Returns:
        ``call(*args)`` returning what ``module(*args)`` returns; the first call compiles.
    """
    fn = torch.compile(module, backend=backend)

    def call(*args: Any) -> Any:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return fn(*args)

    return call


class CompiledLayer(nn.Module):
    """An MoE layer called through :func:`compiled` (same parameters, config and policy).

    Args:
        layer: the :class:`MoELayer`.
        backend: the ``torch.compile`` backend.
    """

    def __init__(self, layer: MoELayer, backend: str) -> None:
        """Wrap ``layer`` (its parameters stay its own)."""
        super().__init__()
        self.layer = layer
        self.config = layer.config
        self.policy = layer.policy
        self.call = compiled(layer, backend)  # a function: not registered as a submodule

    def forward(self, x: torch.Tensor) -> Any:
        """Same as the wrapped layer: ``(out, aux)``, computed by the compiled graph."""
        return self.call(x)


def compiled_layer_method(name: str, layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor,
                          backend: str, budget_bytes: int | None = None) -> Method:
    """:func:`layer_method` of ``layer`` called through ``torch.compile``; peak from the profiler.

    Not modelled (``predict`` is ``None``): the memory model describes the eager schedule.
    """
    return layer_method(name, CompiledLayer(layer, backend), x_TD, grad_TD, modelled=False,
                        budget_bytes=budget_bytes, peak="profiler")


def prepare_compiled(opts: BenchOptions, names: tuple[str, ...]) -> BenchOptions:
    """Before a point: with a compiled method, clear Dynamo's caches; at least 1 warm-up round.

    The first call of a compiled method compiles, so it must not be the memory or a timed call;
    clearing the caches (``torch._dynamo.reset``) lets each point compile its own graphs and
    never run into Dynamo's recompile limit.

    Returns:
        ``opts``, with ``warmup`` raised to 1 when a compiled method runs.
    """
    if not any(n.endswith(COMPILED_SUFFIX) for n in names):
        return opts
    torch._dynamo.reset()
    return dataclasses.replace(opts, warmup=max(1, opts.warmup))


def base_layer(moe: MoEConfig, *, dtype: torch.dtype, device: torch.device, seed: int
               ) -> MoELayer:
    """The layer whose weights every method of a point shares (seeded init, then cast)."""
    torch.manual_seed(seed)
    return MoELayer(moe).to(device=device, dtype=dtype)


def sharing(base: MoELayer, moe: MoEConfig, *, chunk: ChunkConfig | None = None,
            cls: type[MoELayer] = MoELayer) -> MoELayer:
    """A new layer of class ``cls`` that uses ``base``'s parameter objects and buffers.

    Raises:
        ValueError: if ``moe`` changes a size of ``base``'s config.
    """
    sizes = ("hidden_size", "intermediate_size", "num_experts", "top_k", "activation")
    if any(getattr(moe, f) != getattr(base.config, f) for f in sizes):
        raise ValueError(f"a sharing layer must keep the sizes of the base layer, got {moe}")
    layer = cls(moe, chunk=chunk)
    layer.router.weight = base.router.weight
    layer.router.selection_bias = base.router.selection_bias
    layer.experts.w_up = base.experts.w_up
    layer.experts.w_down = base.experts.w_down
    return layer


def layer_inputs(shape: LayerShape, *, dtype: torch.dtype, device: torch.device, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input x (T, d) requiring grad and the incoming gradient (T, d), both N(0, 1), seeded."""
    gen = torch.Generator().manual_seed(seed + 1)
    x_TD = torch.randn(shape.tokens, shape.hidden_size, generator=gen)
    grad_TD = torch.randn(shape.tokens, shape.hidden_size, generator=gen)
    return (x_TD.to(device=device, dtype=dtype).requires_grad_(True),
            grad_TD.to(device=device, dtype=dtype))


def budget_for_rows(moe: MoEConfig, num_tokens: int, dtype_bytes: int, rows: int,
                    device_type: str = "cpu") -> int:
    """The MACT budget that holds chunks of ``rows`` received rows at T = ``num_tokens``.

    The exact predicted layer peak (recompute ``experts``) at c = ⌈T·k / rows⌉ on the
    activations' ``device_type``, so MACT picks that c or a smaller one.
    """
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
    c = -(-num_tokens * moe.top_k // max(rows, 1))
    return policy.layer_peak(num_tokens, dtype_bytes, max(c, 1), device_type=device_type)


def half_rows_budget(moe: MoEConfig, num_tokens: int, dtype_bytes: int,
                     device_type: str = "cpu") -> int:
    """The automatic budget of the layer and model suites: half the received rows per chunk.

    With balanced routing MACT then picks c = 2 (on ``device_type``, the activations'), or
    c = 1 where the unchunked layer's peak is not above c = 2's (tiny layers).
    """
    return budget_for_rows(moe, num_tokens, dtype_bytes,
                           max(1, math.ceil(num_tokens * moe.top_k / 2)), device_type)


def layer_method(name: str, layer: nn.Module, x_TD: torch.Tensor, grad_TD: torch.Tensor, *,
                 modelled: bool = True, budget_bytes: int | None = None,
                 peak: str = "tracker") -> Method:
    """A :class:`Method` running ``layer`` forward + backward under the model's protocol.

    Args:
        name: method name.
        layer: a :class:`MoELayer` (or a wrapper with the same call signature).
        x_TD: (T, d) input requiring grad.
        grad_TD: (T, d) gradient of the output.
        modelled: predict with :func:`layer_memory.moe_layer_memory` (the layer's config on
            x's device, recompute mode, and the chunk count and row blocks of its last call).
        budget_bytes: the MACT budget, reported as the extra ``budget_bytes`` (with the rows
            per fused row block it chose, ``block_rows``).
        peak: the harness's peak measurement (``profiler`` for a compiled layer).
    """
    one = torch.ones((), device=x_TD.device)
    state: dict[str, int | None] = {"num_chunks": 1, "block_rows": None}
    config: MoEConfig = layer.config  # type: ignore[assignment]

    def forward() -> Any:
        out, aux = layer(x_TD)
        state["num_chunks"] = aux.num_chunks
        decision = getattr(layer, "last_decision", None)  # None: compiled, or not a MoELayer
        state["block_rows"] = None if decision is None else decision.block_rows
        return out, aux

    def backward(res: Any) -> None:
        out, aux = res
        torch.autograd.backward([out, aux.load_balancing_loss, aux.z_loss], [grad_TD, one, one])

    def zero_grad() -> None:
        x_TD.grad = None
        for p in layer.parameters():
            p.grad = None

    def predict() -> dict[str, int | None]:
        policy = layer.policy
        assert isinstance(policy, ChunkPolicy), "a modelled layer has a chunk policy"
        recompute = policy.config.resolved_recompute
        m = layer_memory.moe_layer_memory(config, x_TD.shape[0], x_TD.element_size(),
                                          num_chunks=state["num_chunks"] or 1,
                                          recompute=recompute, device_type=x_TD.device.type,
                                          block_rows=state["block_rows"])  # as the call ran
        return {"saved_bytes": m.saved_bytes, "peak_bytes": m.peak_bytes}

    def extras() -> dict[str, Extra]:
        out: dict[str, Extra] = {"num_chunks": (state["num_chunks"] or 1, "chunks")}
        if budget_bytes is not None:
            out["budget_bytes"] = (budget_bytes, "bytes")
            if state["block_rows"] is not None:  # the rows per fused row block MACT chose
                out["block_rows"] = (state["block_rows"], "rows")
        return out

    return Method(name=name, forward=forward, backward=backward, zero_grad=zero_grad,
                  tokens=x_TD.shape[0], exclude=lambda: list(layer.buffers()),
                  predict=predict if modelled else None, extras=extras, peak=peak)


def add_ratios(results: list[Any], *, floor_bytes: int | None = None,
               budget_bytes: dict[str, int] | None = None) -> None:
    """Add ``saved_over_floor`` and ``peak_over_budget`` (ratios) to measured results in place."""
    for res in results:
        if floor_bytes and res.saved_bytes is not None:
            res.extras["saved_over_floor"] = (res.saved_bytes / floor_bytes, "ratio")
        budget = (budget_bytes or {}).get(res.name)
        if budget and res.peak_bytes is not None:
            res.extras["peak_over_budget"] = (res.peak_bytes / budget, "ratio")


ShapeRun = tuple[list[Method], dict[str, Any], str, dict[str, int]]
"""What a suite builds for one shape: ``(methods, config, label, budgets)``: the methods to run,
config entries beyond the shape's, the point's label (the x + H floor is appended) and the MACT
budget of each budgeted method (bytes)."""
ShapeBuild = Callable[[LayerShape], ShapeRun]


def shape_points(suite: str, opts: BenchOptions, device: torch.device, names: tuple[str, ...],
                 *, confs: tuple[int, ...], quick: LayerShape, reference: str,
                 build: ShapeBuild, variant: str = "") -> Iterator[Point]:
    """Run a layer suite over its shapes: one point per shape, x_name ``shape``.

    Args:
        suite: the suite's name.
        opts: the run's options (shapes, dtype, repeats, warm-up).
        device: where the methods run.
        names: the selected methods (for the progress line).
        confs: the default shapes, as MoEBlaze Table 1 rows.
        quick: the shape of ``--quick``.
        reference: the method the terminal table's ratios are taken against.
        build: builds the methods of one shape (see :data:`ShapeBuild`).
        variant: appended to each point's x_value as ``<shape>-<variant>`` (a suite running
            the same shapes on several modules); "" keeps the shape's name.

    Yields:
        One :class:`Point` per shape, with ``saved_over_floor`` (and ``peak_over_budget`` for the
        budgeted methods) added to the results.
    """
    dt = torch.empty((), dtype=opts.torch_dtype).element_size()
    defaults = [table1_shape(c, opts.scale_down) for c in confs]
    for shape in resolve_shapes(opts, defaults, quick):
        opts = prepare_compiled(opts, names)
        announce(suite, shape.label(), opts, len(names))
        floor = shape.floor_bytes(dt)
        methods, config, label, budgets = build(shape)
        results = run_methods(methods, repeats=opts.repeats, warmup=opts.warmup, device=device)
        add_ratios(results, floor_bytes=floor, budget_bytes=budgets)
        x_value = f"{shape.name}-{variant}" if variant else shape.name
        yield Point(suite=suite, x_name="shape", x_value=x_value,
                    label=f"{label}; x + H floor {format_bytes(floor)}",
                    config={**shape.to_dict(), "dtype": opts.dtype, "scale_down": opts.scale_down,
                            "floor_bytes": floor, **config},
                    results=results, reference=reference)
