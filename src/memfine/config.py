"""Frozen, keyword-only configuration dataclasses, validated on construction.

Every check raises ``ValueError`` naming the class, the field, what is allowed and the value received,
e.g. ``MoEConfig.top_k must be in [1, num_experts=8], got 9``. Configs hold plain values only; derive
new ones with :func:`dataclasses.replace`; ``to_dict``/``from_dict`` round-trip and reject unknown keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

ScoreFunc = Literal["softmax", "sigmoid"]
Activation = Literal["swiglu", "geglu", "gelu", "relu", "silu"]
ExpertsImpl = Literal["fused", "plain"]
GemmBackend = Literal["auto", "grouped_mm", "loop", "triton"]
IndexBuilder = Literal["auto", "sort_free", "argsort"]
Recompute = Literal["none", "experts", "full"]
DType = Literal["float32", "bfloat16", "float16", "float64"]

GATED_ACTIVATIONS = ("swiglu", "geglu")

_C = TypeVar("_C", bound="_ConfigBase")


def _fail(obj: object, name: str, allowed: str, value: object) -> None:
    raise ValueError(f"{type(obj).__name__}.{name} must be {allowed}, got {value!r}")


def _check_int(obj: object, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(obj, name, "an int", value)
    if value < lo or (hi is not None and value > hi):
        _fail(obj, name, f"in [{lo}, {hi}]" if hi is not None else f">= {lo}", value)


def _check_float(obj: object, name: str, lo: float, hi: float | None = None, *,
                 lo_open: bool = False) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        _fail(obj, name, "a finite number", value)
    bad_lo = value <= lo if lo_open else value < lo
    if bad_lo or (hi is not None and value > hi) or value == float("inf"):
        left = "(" if lo_open else "["
        _fail(obj, name, f"in {left}{lo}, {hi if hi is not None else 'inf'})", value)


def _check_choice(obj: object, name: str, literal: Any) -> None:
    value = getattr(obj, name)
    allowed = get_args(literal)
    if value not in allowed:
        _fail(obj, name, f"one of {allowed}", value)


class _ConfigBase:
    """Shared ``to_dict``/``from_dict`` for the config dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict (tuples become lists)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _ConfigBase):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        """Build from ``to_dict`` output.

        Raises:
            ValueError: on a key that is not a field of the class.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown}; allowed {sorted(fields)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            sub = _SUBCONFIGS.get((cls.__name__, key))
            if sub is not None and isinstance(value, dict):
                value = sub.from_dict(value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig(_ConfigBase):
    """One MoE feed-forward layer: router and routed experts.

    Attributes:
        hidden_size: d, the model width.
        intermediate_size: n, expert intermediate size per GLU branch.
        num_experts: E, routed experts.
        top_k: k, experts per token, in [1, E].
        score_func: ``softmax`` or ``sigmoid`` router scores (computed in fp32).
        renormalize: rescale the k selected scores to sum to 1 per token. Rejected with
            ``top_k=1`` (every weight would be exactly 1.0 and the router would get no gradient
            from the output).
        activation: expert activation; ``swiglu``/``geglu`` are gated (w_up holds 2n columns).
        experts_impl: ``fused`` (MoEBlaze path, saves x and H) or ``plain`` (autograd over
            gathered/scattered copies).
        gemm_backend: grouped GEMM backend for the expert matmuls.
        index_builder: how the four dispatch index arrays are built.
        aux_loss_coef: weight of the Switch load-balancing loss in the training loss.
        z_loss_coef: weight of the router z-loss in the training loss.
        router_bias_init: std of the normal init of the router weight (0.02 scale by default).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    renormalize: bool = True
    activation: Activation = "swiglu"
    experts_impl: ExpertsImpl = "fused"
    gemm_backend: GemmBackend = "auto"
    index_builder: IndexBuilder = "auto"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        _check_int(self, "hidden_size", 1)
        _check_int(self, "intermediate_size", 1)
        _check_int(self, "num_experts", 1)
        _check_int(self, "top_k", 1)
        if not 1 <= self.top_k <= self.num_experts:
            _fail(self, "top_k", f"in [1, num_experts={self.num_experts}]", self.top_k)
        _check_choice(self, "score_func", ScoreFunc)
        _check_choice(self, "activation", Activation)
        _check_choice(self, "experts_impl", ExpertsImpl)
        _check_choice(self, "gemm_backend", GemmBackend)
        _check_choice(self, "index_builder", IndexBuilder)
        if not isinstance(self.renormalize, bool):
            _fail(self, "renormalize", "a bool", self.renormalize)
        if self.renormalize and self.top_k == 1:
            _fail(self, "renormalize",
                  "False when top_k=1 (renormalised top-1 weights are all 1.0, so the router "
                  "would get no gradient from the output)", self.renormalize)
        _check_float(self, "aux_loss_coef", 0.0)
        _check_float(self, "z_loss_coef", 0.0)

    @property
    def gated(self) -> bool:
        """True for gated activations (w_up has 2n columns)."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def up_width(self) -> int:
        """G: columns of w_up (2n gated, n otherwise)."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkConfig(_ConfigBase):
    """Token chunking of the MoE expert part (MemFine §4).

    Attributes:
        num_chunks: fixed chunk count c (>= 1); ignored when ``memory_budget_bytes`` is set.
        memory_budget_bytes: per-layer MoE activation budget in bytes; when set, c is chosen per
            step and layer from the received tokens (MACT, MemFine Eq. 8-9).
        bins: allowed chunk counts, strictly increasing, starting at 1.
        recompute: ``none`` (no checkpointing), ``experts`` (checkpoint each chunk of the expert
            part), ``full`` (checkpoint the whole transformer layer).
        allow_over_budget: when no bin meets the budget, use the largest bin and warn once
            instead of raising.
    """

    num_chunks: int = 1
    memory_budget_bytes: int | None = None
    bins: tuple[int, ...] = (1, 2, 4, 8)
    recompute: Recompute = "experts"
    allow_over_budget: bool = False

    def __post_init__(self) -> None:
        _check_int(self, "num_chunks", 1)
        if self.memory_budget_bytes is not None:
            _check_int(self, "memory_budget_bytes", 1)
        bins = tuple(self.bins)
        if (not bins or any(isinstance(b, bool) or not isinstance(b, int) for b in bins)
                or bins[0] < 1 or any(a >= b for a, b in zip(bins, bins[1:]))):
            _fail(self, "bins", "a non-empty, strictly increasing tuple of ints >= 1", self.bins)
        object.__setattr__(self, "bins", bins)
        _check_choice(self, "recompute", Recompute)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig(_ConfigBase):
    """A small decoder-only MoE transformer language model.

    Attributes:
        vocab_size: V (256 for the byte tokenizer).
        num_layers: transformer blocks, each attention + MoE feed-forward.
        num_heads: attention heads; ``moe.hidden_size`` must be divisible by it.
        max_seq_len: longest sequence (positions), in tokens.
        moe: the MoE feed-forward configuration (its hidden_size is the model width d).
        chunk: token chunking / recompute of the MoE layers.
        rope_theta: rotary embedding base.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(
        hidden_size=128, intermediate_size=128, num_experts=8, top_k=2))
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_int(self, "vocab_size", 1)
        _check_int(self, "num_layers", 1)
        _check_int(self, "num_heads", 1)
        _check_int(self, "max_seq_len", 1)
        if not isinstance(self.moe, MoEConfig):
            _fail(self, "moe", "a MoEConfig", self.moe)
        if not isinstance(self.chunk, ChunkConfig):
            _fail(self, "chunk", "a ChunkConfig", self.chunk)
        if self.moe.hidden_size % self.num_heads:
            _fail(self, "num_heads", f"a divisor of moe.hidden_size={self.moe.hidden_size}",
                  self.num_heads)
        _check_float(self, "rope_theta", 0.0, lo_open=True)
        _check_float(self, "norm_eps", 0.0, lo_open=True)


_SUBCONFIGS: dict[tuple[str, str], type[_ConfigBase]] = {
    ("ModelConfig", "moe"): MoEConfig,
    ("ModelConfig", "chunk"): ChunkConfig,
}
