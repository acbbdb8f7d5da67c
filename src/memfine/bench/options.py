"""Options of ``memfine bench`` (one field per flag) and the shapes they select.

Shapes: the MoEBlaze Table 1 configurations (docs/design.md §3: ffn n = 4d, SwiGLU) keep d, E, k and
n, and divide the paper's batch × seq by ``scale_down`` (default 256) so that they run on a few CPU
cores; explicit sizes override them (:func:`resolve_shapes`).
Reference: MoEBlaze (arXiv 2601.05296) Table 1; docs/design.md §3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfine._checks import check_choice, fail
from memfine.config import ConfigBase

SUITES = ("experts", "chunking", "model", "hf", "counts")
DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_BACKENDS = ("inductor", "aot_eager")
COUNT_DEVICES = ("cuda", "cpu")
"""Devices whose code path the ``counts`` suite can count (``--count-device``)."""
COMPILED_SUFFIX = "_compiled"
"""A method named ``<method>_compiled`` runs ``<method>`` under ``torch.compile``."""
# MoEBlaze Table 1: conf → (d, E, k, batch, seq); n = 4d.
TABLE1: dict[int, tuple[int, int, int, int, int]] = {
    1: (512, 4, 1, 32, 2048),
    2: (1024, 8, 2, 32, 2048),
    3: (1024, 16, 4, 32, 2048),
    4: (2048, 16, 4, 32, 1024),
    5: (512, 16, 4, 32, 1024),
    6: (1024, 16, 4, 16, 1024),
    7: (2048, 8, 4, 16, 512),
}
SIZE_FIELDS = ("tokens", "hidden_size", "intermediate_size", "num_experts", "top_k")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions(ConfigBase):
    """Resolved options of one ``memfine bench`` run (plain values; see ``--help`` per flag).

    ``to_dict``/``from_dict`` as on the configs (:class:`memfine.config.ConfigBase`).

    Attributes:
        suites: suites to run, from :data:`SUITES`.
        configs: MoEBlaze Table 1 rows (empty: each suite's default).
        scale_down: the paper's batch × seq is divided by this (d, E, k, n unchanged).
        tokens: T, overriding the selected shapes (tokens per step for the model suite).
        hidden_size: d override. intermediate_size: n override (default 4d with a new d).
        num_experts: E override. top_k: k override.
        dtype: ``float32`` or ``bfloat16`` (activations and weights; routers stay fp32).
        threads: torch intra-op threads (``None``: torch's default).
        repeats: timed rounds per method. warmup: untimed rounds first.
        out: output folder (CSV, PNG, JSON).
        quick: tiny shapes, one round, no warm-up, one thread (smoke run).
        methods: subset of each suite's methods (empty: all).
        budget_bytes: MACT byte budget per MoE layer (``None``: the suite's automatic budget).
        skew_levels: received rows as multiples of the balanced share (chunking suite).
        device: ``cpu`` or ``cuda`` (resolved from ``auto``).
        seed: seeds weights, inputs and routing.
        compile: add a ``<method>_compiled`` variant of each selected memfine method of the
            ``experts`` and ``model`` suites (``torch.compile``, ``capture_scalar_outputs`` on).
        compile_backend: the ``torch.compile`` backend of the compiled methods, from
            :data:`COMPILE_BACKENDS` (``aot_eager`` traces without code generation).
        count_device: the device whose code path the ``counts`` suite counts, from
            :data:`COUNT_DEVICES` (``cuda``: its row blocks and its per-token gather combine).
    """

    suites: tuple[str, ...] = SUITES
    configs: tuple[int, ...] = ()
    scale_down: int = 256
    tokens: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    dtype: str = "float32"
    threads: int | None = None
    repeats: int = 5
    warmup: int = 1
    out: str = "runs/bench"
    quick: bool = False
    methods: tuple[str, ...] = ()
    budget_bytes: int | None = None
    skew_levels: tuple[int, ...] = (1, 2, 4, 8)
    device: str = "cpu"
    seed: int = 0
    compile: bool = False
    compile_backend: str = "inductor"
    count_device: str = "cuda"

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        if not self.suites or any(s not in SUITES for s in self.suites):
            fail(self, "suites", f"a non-empty subset of {SUITES}", self.suites)
        if any(c not in TABLE1 for c in self.configs):
            fail(self, "configs", f"Table 1 rows in {sorted(TABLE1)}", self.configs)
        for name in ("scale_down", "repeats", *SIZE_FIELDS, "threads", "budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                fail(self, name, "an int >= 1" + ("" if name in ("scale_down", "repeats")
                                                   else " or None"), value, "an int >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            fail(self, "warmup", "an int >= 0", self.warmup)
        check_choice(self, "dtype", DTYPES)
        check_choice(self, "compile_backend", COMPILE_BACKENDS)
        check_choice(self, "count_device", COUNT_DEVICES)
        if not isinstance(self.compile, bool):
            fail(self, "compile", "a bool", self.compile)
        if self.device not in ("cpu", "cuda"):
            fail(self, "device", "'cpu' or 'cuda'", self.device)
        if not self.skew_levels or any(s < 1 for s in self.skew_levels) or list(
                self.skew_levels) != sorted(set(self.skew_levels)):
            fail(self, "skew_levels", "strictly increasing ints >= 1", self.skew_levels)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``dtype``."""
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def explicit_sizes(self) -> dict[str, int]:
        """The size overrides that were given (field → value)."""
        return {name: getattr(self, name) for name in SIZE_FIELDS
                if getattr(self, name) is not None}


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerShape:
    """The sizes of one benchmarked MoE layer.

    Attributes:
        name: ``conf<N>`` for a Table 1 row, ``custom`` or ``quick``.
        tokens: T, tokens entering the layer.
        hidden_size: d. intermediate_size: n (per GLU branch). num_experts: E. top_k: k.
        paper_tokens: the paper's batch × seq for a Table 1 row, else ``None``.
    """

    name: str
    tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    paper_tokens: int | None = None

    def label(self) -> str:
        """``conf3: d=1024 n=4096 E=16 k=4 T=256 (paper 65536 = T × 256)``."""
        text = (f"{self.name}: d={self.hidden_size} n={self.intermediate_size} "
                f"E={self.num_experts} k={self.top_k} T={self.tokens}")
        if self.paper_tokens is not None:
            text += f" (paper batch×seq {self.paper_tokens})"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def floor_bytes(self, dtype_bytes: int) -> int:
        """(T·d + 2·T·k·n) · D_t: x + H, the no-recompute floor (docs/design.md §5; SwiGLU)."""
        T, D, N, K = self.tokens, self.hidden_size, self.intermediate_size, self.top_k
        return (T * D + 2 * T * K * N) * dtype_bytes


def table1_shape(conf: int, scale_down: int) -> LayerShape:
    """Table 1 row ``conf`` with T = batch · seq / scale_down (at least 1)."""
    d, E, k, batch, seq = TABLE1[conf]
    return LayerShape(name=f"conf{conf}", tokens=max(1, batch * seq // scale_down),
                      hidden_size=d, intermediate_size=4 * d, num_experts=E, top_k=k,
                      paper_tokens=batch * seq)


def _override(shape: LayerShape, sizes: dict[str, int], name: str | None = None) -> LayerShape:
    if "hidden_size" in sizes and "intermediate_size" not in sizes:
        sizes = {**sizes, "intermediate_size": 4 * sizes["hidden_size"]}
    same_tokens = sizes.get("tokens", shape.tokens) == shape.tokens
    paper = shape.paper_tokens if same_tokens and not name else None
    return dataclasses.replace(shape, name=name or shape.name, paper_tokens=paper, **sizes)


def resolve_shapes(opts: BenchOptions, defaults: Sequence[LayerShape], quick: LayerShape
                   ) -> list[LayerShape]:
    """The shapes a layer suite runs.

    ``--configs``: those Table 1 rows, each with the explicit sizes applied. Otherwise
    ``--quick``: ``quick`` with the explicit sizes applied. Otherwise explicit sizes: one
    ``custom`` shape, the fields not given from the first default. Otherwise the defaults.

    Raises:
        ValueError: when the sizes give k > E.
    """
    sizes = opts.explicit_sizes()
    if opts.configs:
        shapes = [_override(table1_shape(c, opts.scale_down), sizes) for c in opts.configs]
    elif opts.quick:
        shapes = [_override(quick, sizes)]
    elif sizes:
        shapes = [_override(defaults[0], sizes, "custom")]
    else:
        shapes = list(defaults)
    for s in shapes:
        if s.top_k > s.num_experts:
            raise ValueError(f"--top-k must be at most --num-experts: the {s.name} shape has "
                             f"k {s.top_k} and E {s.num_experts}")
    return shapes


@dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    """The results of one benchmark point (one shape, or one skew level).

    Attributes:
        suite: suite name (the CSV's ``benchmark``).
        x_name: what varies across the suite's points (``table1_conf``, ``skew``, ...).
        x_value: this point's value.
        label: one human line (shape, tokens, budget).
        config: the point's configuration, written as JSON in every CSV row.
        results: one :class:`memfine.bench.harness.MethodResult` per method.
        reference: the method that ratios in the terminal table are taken against.
    """

    suite: str
    x_name: str
    x_value: str
    label: str
    config: dict[str, Any]
    results: list[Any]
    reference: str


def announce(suite: str, what: str, opts: BenchOptions, num_methods: int) -> None:
    """Print the start of one point (flushed, so progress shows in logs)."""
    print(f"[{suite}] {what}: {num_methods} methods x ({opts.warmup} warm-up + 1 memory + "
          f"{opts.repeats} timed) calls, interleaved", flush=True)


def bench_device(choice: str) -> torch.device:
    """The device of a run: ``cpu``, ``cuda`` (or ``cuda:i``), or ``auto`` (CUDA when present).

    Raises:
        ValueError: naming ``--device`` for an unknown choice, or CUDA where there is none.
    """
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda[:i] or auto, got {choice!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {choice}: CUDA is not available in this torch build or "
                         f"machine (torch {torch.__version__})")
    return device
