"""The shared base of the config dataclasses, their ``Literal`` types and constants.

Every check raises ``ValueError`` naming the class, the field, what is allowed and the value
received, e.g. ``MoEConfig.top_k must be in [1, num_experts=8], got 9``. Configs hold plain values
only; derive new ones with :func:`dataclasses.replace`; ``to_dict``/``from_dict`` round-trip and
reject unknown keys. Byte units and their formatting are in :mod:`memfine.units`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar, get_args

ScoreFunc = Literal["softmax", "sigmoid", "sqrtsoftplus"]
Activation = Literal["swiglu", "geglu", "gelu", "relu", "relu2", "silu"]
"""The named expert activations: the keys of ``memfine.activations.ACTIVATIONS`` (checked
when that module is imported)."""
GateFn = Literal["silu", "gelu"]
"""``GatedActivation.gate_fn``: the keys of ``memfine.activations.GATE_FUNCTIONS``."""
ExpertsImpl = Literal["fused", "plain"]
GemmBackend = Literal["auto", "grouped_mm", "loop", "triton"]
IndexBuilder = Literal["auto", "sort_free", "argsort"]
RecomputeMode = Literal["none", "experts", "full"]
# What a memory budget bounds: each MoE layer call (MACT) or the whole training step.
BudgetScope = Literal["layer", "step"]
"""What a layer keeps for backward: the one table of recompute modes (documented once, in
:mod:`memfine.schedule.chunked`); configs, the memory plan, its search and the CLI read it."""
Recompute = Literal["auto", RecomputeMode]
"""A :class:`ChunkConfig`'s setting: a mode, or ``auto`` (``ChunkConfig.resolved_recompute``)."""
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = get_args(RecomputeMode)
DType = Literal["float32", "bfloat16", "float16", "float64"]
DropPolicy = Literal["probs", "position"]
AutocastDType = Literal["none", "bfloat16"]

GATED_ACTIVATIONS = ("swiglu", "geglu")
"""The gated names of :data:`Activation` (H holds gate and up: G = 2n)."""
ACTIVATIONS_SAVING_OUTPUT = ("relu",)
"""Names of :data:`Activation` whose autograd node keeps A, not H (the plain path's memory)."""
MAX_BIN = 16
"""Largest chunk-count bin of :attr:`ChunkConfig.bins` (the memory model's proven bound)."""

_C = TypeVar("_C", bound="ConfigBase")

class ConfigBase:
    """Shared ``to_dict``/``from_dict`` for the config dataclasses."""

    __slots__ = ()  # keeps the subclasses' ``slots=True`` effective (no instance __dict__)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict (tuples become lists)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, ConfigBase):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def differing_fields(self, other: ConfigBase) -> list[str]:
        """Names of the fields whose values differ from ``other``'s (a config of this class)."""
        return [f.name for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != getattr(other, f.name)]

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        """Build from ``to_dict`` output.

        Raises:
            ValueError: if ``data`` is not a dict, on a key that is not a field of the class, or
                when a field without a default is missing (naming the class, the missing keys
                and the allowed ones).
        """
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}.from_dict expects a dict, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown}; allowed {sorted(fields)}")
        missing = sorted(name for name, f in fields.items() if f.init and name not in data
                         and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"{cls.__name__}: missing keys {missing} (they have no default); "
                             f"allowed {sorted(fields)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            sub = _SUBCONFIGS.get((cls.__name__, key))
            if sub is not None and isinstance(value, dict):
                value = sub.from_dict(value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)



_SUBCONFIGS: dict[tuple[str, str], type[ConfigBase]] = {}
"""(class name, field) → the config class a nested dict of ``from_dict`` is built into."""
