"""``experts`` suite: one MoE layer (router + experts) forward + backward, seven ways.

Methods (same weights, input, routing and incoming gradients):

- ``plain``: what most PyTorch MoE code does — gather the rows into a copy, one matmul per
  expert, scatter back (:func:`memfine.experts.experts_plain` on the ``loop`` backend);
- ``expert_loop``: a Python loop over experts with index masks (transformers ``eager`` style);
- ``grouped_mm``: the same copies with ``torch._grouped_mm`` (torchtitan style);
- ``torchtitan``: torchtitan's own ``RoutedExperts`` (dispatcher + ``GroupedExperts``) on views of
  the same weights, behind memfine's router
  (:func:`memfine.baselines.titan_style.torchtitan_layer`; bf16 GEMMs whatever ``--dtype``,
  as torchtitan's code casts); skipped with a line naming the reason when torchtitan 0.3 cannot
  be imported;
- ``fused``: memfine's fused expert Function (saves x and H only; MoEBlaze);
- ``fused_mact``: fused, chunked with per-chunk recompute, c chosen by MACT from a byte budget
  (default: the budget of half the received rows per chunk: c = 2, or 1 where c = 1 fits);
- ``full_recompute``: checkpoint around the whole ``grouped_mm`` layer (full activation
  checkpointing, as torchtitan's full AC does).

With ``--compile``: ``fused_compiled`` and ``fused_mact_compiled``, the same layers under
``torch.compile`` (inductor by default; MACT's decision is the one graph break), peak bytes
measured with ``torch.profiler`` and not modelled.

The methods are one table, :data:`LAYER_METHODS` (name → :class:`LayerMethod`): a new baseline is
one entry there (docs/extending.md); ``METHODS`` and ``COMPILABLE`` are read from it.

Shapes: MoEBlaze Table 1 rows 1, 2, 3, 5 (d ≤ 1024) with batch × seq / 256 by default.
Legend: T tokens, D = d.
Reference: MoEBlaze §5 and Table 1; MemFine §4; docs/design.md §3, §5, §7.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from memfine.baselines.layers import (
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
from memfine.baselines.titan_style import torchtitan_layer, torchtitan_missing
from memfine.bench.harness import Method
from memfine.bench.options import (
    COMPILED_SUFFIX,
    BenchOptions,
    LayerShape,
    Point,
    resolve_shapes,
    table1_shape,
)
from memfine.config import ChunkConfig, GemmBackend, MoEConfig
from memfine.nn import MoELayer
from memfine.schedule.policy import ChunkPolicy
from memfine.units import format_bytes

NAME = "experts"
REFERENCE = "fused"
DEFAULT_CONFS = (1, 2, 3, 5)
QUICK = LayerShape(name="quick", tokens=64, hidden_size=64, intermediate_size=128,
                   num_experts=4, top_k=2)


def moe_config(shape: LayerShape, **overrides: object) -> MoEConfig:
    """SwiGLU MoE config of a shape (renormalised top-k weights when k > 1)."""
    return MoEConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                     num_experts=shape.num_experts, top_k=shape.top_k,
                     renormalize=shape.top_k > 1, **overrides)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ShapeSetup:
    """What every method of one shape shares.

    Attributes:
        moe: the shape's :class:`MoEConfig` (:func:`moe_config`).
        base: the layer whose parameters every method uses (:func:`sharing`).
        budget_bytes: the MACT budget of the budgeted methods (bytes).
    """

    moe: MoEConfig
    base: MoELayer
    budget_bytes: int

    def plain(self, backend: GemmBackend) -> MoEConfig:
        """The shape's config on memfine's plain path (gathered copies) with ``backend``."""
        return dataclasses.replace(self.moe, experts_impl="plain", gemm_backend=backend)


@dataclasses.dataclass(frozen=True)
class LayerMethod:
    """One method of the suite: how to build its layer and what the harness reports for it.

    Attributes:
        layer: builds the method's layer (a :class:`MoELayer` or a module with its call
            signature and a ``config``) on the shape's shared weights.
        modelled: the memory model predicts the layer (a :class:`MoELayer` with a chunk policy).
        budgeted: the layer runs MACT under :attr:`ShapeSetup.budget_bytes`.
        compilable: ``--compile`` adds ``<name>_compiled`` (a :class:`MoELayer` only).
        missing: None, or a function saying why the method cannot run here (e.g. a package
            that is not installed); the method is then skipped with that line.
    """

    layer: Callable[[ShapeSetup], nn.Module]
    modelled: bool = True
    budgeted: bool = False
    compilable: bool = False
    missing: Callable[[], str | None] | None = None


def method_table(entries: dict[str, LayerMethod]) -> dict[str, LayerMethod]:
    """The method table as given, once every entry is checked (at import, for LAYER_METHODS).

    Raises:
        ValueError: naming the method and the field: an entry that is not a
            :class:`LayerMethod`, a ``layer``/``missing`` that is not callable, a flag that is
            not a bool.
    """
    for name, entry in entries.items():
        where = f"bench suite {NAME!r}, method {name!r} (LAYER_METHODS in {__name__})"
        if not isinstance(entry, LayerMethod):
            raise ValueError(f"{where}: the entry must be a LayerMethod(layer, modelled=..., "
                             f"budgeted=..., compilable=..., missing=...), got "
                             f"{type(entry).__name__}")
        if not callable(entry.layer):
            raise ValueError(f"{where}: field 'layer' must be a callable ShapeSetup -> module, "
                             f"got {type(entry.layer).__name__}")
        for field in ("modelled", "budgeted", "compilable"):
            if not isinstance(getattr(entry, field), bool):
                raise ValueError(f"{where}: field {field!r} must be a bool, got "
                                 f"{getattr(entry, field)!r}")
        if entry.missing is not None and not callable(entry.missing):
            raise ValueError(f"{where}: field 'missing' must be None or a callable returning "
                             f"why the method cannot run, got {type(entry.missing).__name__}")
    return entries


def _mact(setup: ShapeSetup) -> MoELayer:
    chunk = ChunkConfig(memory_budget_bytes=setup.budget_bytes, recompute="experts")
    return sharing(setup.base, setup.moe, chunk=chunk)


LAYER_METHODS: dict[str, LayerMethod] = method_table({
    "plain": LayerMethod(lambda s: sharing(s.base, s.plain("loop"))),
    "expert_loop": LayerMethod(lambda s: sharing(s.base, s.moe, cls=ExpertLoopMoELayer),
                               modelled=False),
    "grouped_mm": LayerMethod(lambda s: sharing(s.base, s.plain("grouped_mm"))),
    "torchtitan": LayerMethod(lambda s: torchtitan_layer(s.base, s.moe), modelled=False,
                              missing=torchtitan_missing),
    "fused": LayerMethod(lambda s: sharing(s.base, s.moe), compilable=True),
    "fused_mact": LayerMethod(_mact, budgeted=True, compilable=True),
    "full_recompute": LayerMethod(
        lambda s: CheckpointedLayer(sharing(s.base, s.plain("grouped_mm"))), modelled=False),
})
"""Every method of the suite, in table order: the one place a method is named."""
METHODS = tuple(LAYER_METHODS)
COMPILABLE = tuple(name for name, m in LAYER_METHODS.items() if m.compilable)


def _checked_layer(name: str, entry: object, setup: ShapeSetup) -> nn.Module:
    """The entry's layer, or ValueError naming the method and what its entry lacks."""
    where = f"bench suite {NAME!r}, method {name!r} (LAYER_METHODS in {__name__})"
    if not isinstance(entry, LayerMethod):
        raise ValueError(f"{where}: the entry must be a LayerMethod, got {type(entry).__name__}")
    layer = entry.layer(setup)
    if not isinstance(layer, nn.Module) or not isinstance(getattr(layer, "config", None),
                                                          MoEConfig):
        raise ValueError(f"{where}: layer() must return a module with an MoEConfig `config` "
                         f"called as layer(x) -> (out, aux), got {type(layer).__name__}")
    if entry.modelled and not isinstance(getattr(layer, "policy", None), ChunkPolicy):
        raise ValueError(f"{where}: modelled=True needs an MoELayer (the memory model predicts "
                         f"its chunk policy); {type(layer).__name__} has none: set "
                         "modelled=False")
    if entry.compilable and not isinstance(layer, MoELayer):
        raise ValueError(f"{where}: compilable=True needs an MoELayer, got "
                         f"{type(layer).__name__}")
    return layer


def _eager(name: str) -> str:
    """The table name of a selected method (``<method>_compiled`` → ``<method>``)."""
    return name if name in LAYER_METHODS else name.removesuffix(COMPILED_SUFFIX)


def skipped_methods(names: tuple[str, ...]) -> dict[str, str]:
    """The selected methods that cannot run here (``<method>_compiled`` included) → why."""
    skipped = {}
    for name in names:
        entry = LAYER_METHODS.get(_eager(name))
        reason = entry.missing() if isinstance(entry, LayerMethod) and entry.missing else None
        if reason is not None:
            skipped[name] = reason
    return skipped


def build_methods(shape: LayerShape, opts: BenchOptions, device: torch.device,
                  names: tuple[str, ...]) -> tuple[list[Method], int]:
    """The selected methods of one shape, and the MACT budget in bytes.

    Raises:
        ValueError: for a name that is not in :data:`LAYER_METHODS` (nor a compiled variant of
            a compilable entry), or an entry that cannot build its layer (naming the method).
    """
    unknown = [n for n in names if n not in LAYER_METHODS
               and n.removesuffix(COMPILED_SUFFIX) not in COMPILABLE]
    if unknown:
        raise ValueError(f"bench suite {NAME!r}: unknown method(s) {unknown}; the suite's "
                         f"methods are the keys of LAYER_METHODS in {__name__}: {list(METHODS)} "
                         f"(and {[n + COMPILED_SUFFIX for n in COMPILABLE]})")
    moe = moe_config(shape)
    dtype = opts.torch_dtype
    base = base_layer(moe, dtype=dtype, device=device, seed=opts.seed)
    x_TD, grad_TD = layer_inputs(shape, dtype=dtype, device=device, seed=opts.seed)
    budget = opts.budget_bytes or half_rows_budget(moe, shape.tokens, x_TD.element_size(),
                                                   x_TD.device.type)
    setup = ShapeSetup(moe=moe, base=base, budget_bytes=budget)
    methods = []
    for name in names:
        eager = _eager(name)
        entry = LAYER_METHODS[eager]
        layer = _checked_layer(eager, entry, setup)
        budget_bytes = budget if entry.budgeted else None
        if name != eager:
            assert isinstance(layer, MoELayer)  # _checked_layer: compilable entries
            methods.append(compiled_layer_method(name, layer, x_TD, grad_TD,
                                                 opts.compile_backend, budget_bytes))
        else:
            methods.append(layer_method(name, layer, x_TD, grad_TD, modelled=entry.modelled,
                                        budget_bytes=budget_bytes))
    return methods, budget


def shapes(opts: BenchOptions, confs: tuple[int, ...] = DEFAULT_CONFS) -> list[LayerShape]:
    """The suite's shapes, resolved by the runner before its first line.

    Raises:
        ValueError: when the sizes give k > E (:func:`memfine.bench.options.resolve_shapes`).
    """
    return resolve_shapes(opts, [table1_shape(c, opts.scale_down) for c in confs], QUICK)


def budget_calls(opts: BenchOptions, names: tuple[str, ...]
                 ) -> list[tuple[str, MoEConfig, ChunkConfig, int]]:
    """(point, MoE config, chunk config, T) of each ``--memory-budget`` layer call to run."""
    if not any(LAYER_METHODS[_eager(n)].budgeted for n in names if _eager(n) in LAYER_METHODS):
        return []
    chunk = ChunkConfig(memory_budget_bytes=opts.budget_bytes, recompute="experts")  # _mact's
    return [(s.name, moe_config(s), chunk, s.tokens) for s in shapes(opts)]


def run(opts: BenchOptions, device: torch.device, names: tuple[str, ...]
        ) -> Iterator[Point]:
    """Run the suite: one point per shape (methods that cannot run here skipped with a line)."""
    skipped = skipped_methods(names)
    for name, reason in skipped.items():
        print(f"{NAME}: {name} skipped: {reason}")
    names = tuple(n for n in names if n not in skipped)

    def build(shape: LayerShape) -> ShapeRun:
        methods, budget = build_methods(shape, opts, device, names)
        budgets = {n: budget for n in names if n in LAYER_METHODS and LAYER_METHODS[n].budgeted}
        return (methods, {"activation": "swiglu", "budget_bytes": budget},
                f"{shape.label()} {opts.dtype}; MACT budget {format_bytes(budget)}", budgets)

    yield from shape_points(NAME, opts, device, names, confs=DEFAULT_CONFS, quick=QUICK,
                            reference=REFERENCE, build=build)
