"""The MoE layer's config: router, routed experts and their activation (:class:`MoEConfig`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from memfine._checks import check_choice, check_float, check_int, fail
from memfine.config.base import (
    GATED_ACTIVATIONS,
    Activation,
    ConfigBase,
    ExpertsImpl,
    GateFn,
    GemmBackend,
    IndexBuilder,
    ScoreFunc,
)
from memfine.config.routing import RouteOptions
from memfine.units import INT64_MAX


@dataclass(frozen=True, kw_only=True, slots=True)
class GatedActivation(ConfigBase):
    """A = f_α(min(gate, limit)) ⊙ (clamp(up, -limit, limit) + up_offset), row by row.

    ``swiglu`` is ``GatedActivation()``, ``geglu`` ``GatedActivation(gate_fn="gelu")``, GPT-OSS's
    clamped SwiGLU :meth:`gpt_oss`. Computed by :mod:`memfine.activations`.

    Attributes:
        gate_fn: a :data:`memfine.config.GateFn`: ``silu`` (f_α(g) = g·σ(α·g)) or ``gelu``
            (tanh approximation; needs α = 1); formulas in
            ``memfine.activations.GATE_FUNCTIONS``.
        alpha: α > 0 (1.0: plain SiLU; GPT-OSS: 1.702).
        limit: clamp bound > 0 (gate clamped from above, up to ±limit), or None for no clamp.
        up_offset: added to the (clamped) up half (GPT-OSS: 1.0).
        interleaved: gate/up columns of H interleaved (gate 0, 2, 4, ...; up 1, 3, ...) instead
            of the halves ``[gate | up]``.
        upcast: compute in fp32 and cast the result back (a no-op for fp32 H).

    Reference: transformers' ``GptOssExperts._apply_gate`` (GPT-OSS; our reading of its code)
    and ``DeepseekV4Experts._apply_gate`` (the clamp with α = 1, offset 0).
    """

    gate_fn: GateFn = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    interleaved: bool = False
    upcast: bool = False

    def __post_init__(self) -> None:
        """Validate every field; raise ValueError naming the field, allowed values and value."""
        check_choice(self, "gate_fn", GateFn)
        check_float(self, "alpha", 0.0, lo_open=True)
        if self.gate_fn == "gelu" and self.alpha != 1.0:
            fail(self, "alpha", "1.0 with gate_fn='gelu'", self.alpha)
        if self.limit is not None:
            check_float(self, "limit", 0.0, lo_open=True)
        if isinstance(self.up_offset, bool) or not isinstance(self.up_offset, (int, float)) \
                or abs(self.up_offset) == float("inf") or self.up_offset != self.up_offset:
            fail(self, "up_offset", "a finite number", self.up_offset)
        for name in ("interleaved", "upcast"):
            if not isinstance(getattr(self, name), bool):
                fail(self, name, "a bool", getattr(self, name))

    @classmethod
    def gpt_oss(cls, alpha: float = 1.702, limit: float = 7.0) -> GatedActivation:
        """GPT-OSS: interleaved gate/up, (clamp(up, ±L) + 1) · g'·σ(α·g'), g' = min(gate, L)."""
        return cls(alpha=alpha, limit=limit, up_offset=1.0, interleaved=True)


DEFAULT_BACKWARD_BLOCK_BYTES = 16 * 2**20
"""Byte target of one row block of the fused forward and backward on the CPU (16 MiB; the CPU's
default block holds at most :data:`CPU_MAX_BLOCK_ROWS` rows). Against 4, 8, 32, 64 MiB and one
block in the last run (T 4096, one thread, thread CPU time, interleaved, medians of per-round
ratios to the default's time): at the coarse layer, where the default is 16 MiB's own 630 rows,
16 MiB took 0.88× (p20-p80 0.86-1.07: the rounds' noise) and the fastest other size, 32 MiB,
0.94×; at the fine-grained layer 16 MiB 1.01× and the fastest, 32 MiB, 0.96× (p20-p80
0.94-1.12); at the training preset's 16 MiB 1.03× and the fastest, 8 MiB, 0.99× (p20-p80
0.98-1.01). No size is faster than the default beyond the rounds' spread at any shape; one
block is 1.10×, 1.29× and 1.05× its time (``benchmarks/bench_block_bytes.py``,
``benchmarks/results/block_bytes_cpu.csv``)."""

CUDA_BACKWARD_BLOCK_BYTES = 512 * 2**20
"""The least byte target of one row block on CUDA (and any other accelerator): 512 MiB, the
default on a device of 16 GiB or less and wherever the device's memory is not known
(:func:`default_block_bytes`)."""

DEVICE_MEMORY_BLOCK_DIVISOR = 32
"""On CUDA the default row block is the device's memory ÷ 32 (at least 512 MiB).

A block's transients are live once per layer backward, not per layer: 1/32 of the device
(4.4 GB on a 141 GB H200, 2.5 GB on an 80 GB H100) costs about 3% of its memory once, and at
the Qwen3-30B-A3B layer (d 2048, n 768, k 8, bf16: 19,968 bytes a row) it holds all of T 16384's
131,072 rows (2.6 GB) in one block on an H200. Every further block pays about 30 more ATen
launches, and weight-gradient writes per expert it holds (the counts suite:
``fused_512mib``, ``benchmarks/results/counts/bench_counts.csv``); a memory budget still runs
half and a quarter of these rows (:data:`BUDGET_BLOCK_DIVISORS`) before it chunks."""


def default_block_bytes(device_type: str, total_memory: int | None = None) -> int:
    """The row-block byte target used when ``MoEConfig.backward_block_bytes`` is None.

    Args:
        device_type: ``torch.device.type`` of the activations (``cpu``, ``cuda``, ...).
        total_memory: the accelerator's memory, bytes; None reads the current CUDA device's
            (``torch.cuda.get_device_properties``) when ``device_type`` is ``cuda`` and CUDA
            is available, else it is unknown.

    Returns:
        :data:`DEFAULT_BACKWARD_BLOCK_BYTES` on the CPU; elsewhere max(512 MiB, memory ÷
        :data:`DEVICE_MEMORY_BLOCK_DIVISOR`), 512 MiB (:data:`CUDA_BACKWARD_BLOCK_BYTES`)
        where the memory is unknown.

    Raises:
        ValueError: ``total_memory`` not None and not a positive int.
    """
    if device_type == "cpu":
        return DEFAULT_BACKWARD_BLOCK_BYTES
    if total_memory is None and device_type == "cuda":
        total_memory = _cuda_memory()
    if total_memory is None:
        return CUDA_BACKWARD_BLOCK_BYTES
    if isinstance(total_memory, bool) or not isinstance(total_memory, int) or total_memory < 1:
        raise ValueError(f"total_memory must be a positive int (bytes) or None, got "
                         f"{total_memory!r}")
    return max(CUDA_BACKWARD_BLOCK_BYTES, total_memory // DEVICE_MEMORY_BLOCK_DIVISOR)


def _cuda_memory() -> int | None:
    """The current CUDA device's memory in bytes, None without a CUDA device that starts."""
    import torch  # lazily: the config package imports no torch at module level

    if not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except (RuntimeError, AssertionError):  # a CUDA build that cannot start here
        return None


BUDGET_BLOCK_DIVISORS = (1, 2, 4)
"""The row blocks a memory budget may run, as divisors of the rows of the device's default.

Under a memory budget (MACT) with ``backward_block_bytes=None`` the chunk policy tries, per
chunk count c, the default block and then half and a quarter of its rows, and runs the largest
that fits (:func:`budget_block_ladder`), before it takes a larger c: a smaller block only splits
the grouped GEMMs further (on the CPU a 4 MiB block took 1.11× and 1.06× the default's time at
the coarse and fine-grained layers, ``benchmarks/results/block_bytes_cpu.csv``), while every
chunk adds its own routing index, chunk loop step and, under expert parallelism, its own
all-to-alls (a budget recomputes the experts at every c). Still smaller blocks would trade
kernel launches (CUDA) and weight-gradient passes for bytes that chunking frees."""


def budget_block_ladder(block_bytes: int | None, device_type: str, row_bytes: int
                        ) -> tuple[int | None, ...]:
    """The row blocks a budgeted layer may run, largest first.

    Args:
        block_bytes: ``MoEConfig.backward_block_bytes``: a set value is the only block.
        device_type: the activations' device type (None's default, :func:`default_block_bytes`).
        row_bytes: bytes of one block row, (3·d + 3·n + G)·D_t (:func:`block_row_bytes`).

    Returns:
        ``(block_bytes,)`` when set; else None (the device's default block, its own value:
        :func:`backward_block_rows` gives its rows), then the byte targets of exactly half and a
        quarter of the default's rows (:data:`BUDGET_BLOCK_DIVISORS`; about 16, 8 and 4 MiB on
        the CPU, 512, 256 and 128 MiB on a CUDA device of 16 GiB or less, 1/32, 1/64 and
        1/128 of a larger device's memory; at a layer whose default is raised to
        :data:`MIN_BLOCK_ROWS`, 256 and 128 rows).

    Reference: MoEBlaze §4.2 (row tiles); MemFine §4.2 (MACT's budget); our ladder.
    """
    if block_bytes is not None:
        return (block_bytes,)
    rows = _default_rows(device_type, row_bytes)
    return (None, *(max(1, rows // q) * row_bytes for q in BUDGET_BLOCK_DIVISORS[1:]))


def block_row_bytes(hidden_size: int, intermediate_size: int, up_width: int,
                    dtype_bytes: int) -> int:
    """Bytes of one row of a streamed block: (3·d + 3·n + G)·D_t (:func:`backward_block_rows`)."""
    return (3 * hidden_size + 3 * intermediate_size + up_width) * dtype_bytes


def _default_rows(device_type: str, row_bytes: int) -> int:
    """Rows of the device's default block: its byte target's, at least :data:`MIN_BLOCK_ROWS`.

    On the CPU at most :data:`CPU_MAX_BLOCK_ROWS`.
    """
    rows = max(MIN_BLOCK_ROWS, default_block_bytes(device_type) // row_bytes)
    if device_type == "cpu" and CPU_MAX_BLOCK_ROWS is not None:
        return min(rows, CPU_MAX_BLOCK_ROWS)
    return rows


CPU_MAX_BLOCK_ROWS: int | None = 1024
"""Rows the CPU's default block holds at most (None: no cap; the counts suite lifts it while it
counts another device's path on the CPU).

16 MiB holds 1,927 rows at the fine-grained layer (d 512, n 128, fp32) and 4,096 at the
training preset's (d = n = 128): at the fine-grained layer one block's backward transients
(4.7 MiB) were most of the fused peak's excess over its live floor at T 1,024 and 4,096; with
1,024 rows (2.5 MiB) and the router node the peak is 1.046× and 1.037× the floor there
(``benchmarks/results/peak_cpu_fine.csv``). 16 MiB's uncapped blocks took 1.01× (p20 0.96,
p80 1.06) the capped default's time at the fine-grained layer and 1.03× (p20 1.02, p80 1.05)
at the preset's, T 4096, one thread, thread CPU time, interleaved
(``benchmarks/bench_block_bytes.py``, ``benchmarks/results/block_bytes_cpu.csv``); layers whose
16 MiB holds fewer rows (the coarse d 512, n 1024 layer: 630) are unchanged."""


MIN_BLOCK_ROWS = 512
"""Rows the device's default block (``backward_block_bytes=None``) holds at least.

A block boundary inside an expert's rows splits that expert's products in two, and each piece
of its weight gradient reads and writes the expert's whole (d, G) and (n, d) matrices: a fixed
cost per boundary against a block's B rows of work. At wide layers 16 MiB holds few rows (178 at
d 1024, n 4096 in fp32), and the boundaries cost 6-8% of the experts suite's layer time there
(``benchmarks/profile_experts.py``). 512 rows leave every layer whose 16 MiB holds more rows
unchanged (the coarse d 512, n 1024 layer: 630) and keep the fused peak below the copies-based
layers' at the suite's shapes, where 1,024 rows did not. A set ``backward_block_bytes`` (of any
value, 16 MiB included), a budget's smaller blocks and the tests' tiny blocks are taken as they
are: the default is None, never recognised by its byte size."""


def check_block_bytes(block_bytes: object, row_bytes: int, where: str) -> None:
    """ValueError unless ``block_bytes`` is None or an int from one row to int64's largest.

    Args:
        block_bytes: the value given.
        row_bytes: bytes of one block row (the least a block holds).
        where: how the message names the field (``MoEConfig.backward_block_bytes``).
    """
    if block_bytes is None:
        return
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) \
            or not row_bytes <= block_bytes <= INT64_MAX:
        raise ValueError(f"{where} must be None (the device's default) or an int in "
                         f"[{row_bytes}, {INT64_MAX}] (one block row, (3·d + 3·n + G) elements "
                         f"at 2 bytes each, G = 2n gated or n, up to int64's largest; "
                         f"memfine.units.parse_bytes reads '16MiB'), got {block_bytes!r}")


def backward_block_rows(block_bytes: int | None, hidden_size: int, intermediate_size: int,
                        up_width: int, dtype_bytes: int, device_type: str = "cpu") -> int:
    """Rows per block of the streamed fused forward and backward: the one place they are set.

    One row of a block costs (3·d + 3·n + G)·D_t bytes of backward transients: dO, gathered x
    and dx rows (d each), dA, A and one activation temporary (n each) and dH (G); the forward's
    per-row transients (x rows, the H product, A, Y: (2·d + G + n)·D_t) are smaller.

    Args:
        block_bytes: byte target of one block, ≥ 1, or None for the device's default
            (:func:`default_block_bytes`, at least :data:`MIN_BLOCK_ROWS` rows).
        hidden_size: d.
        intermediate_size: n.
        up_width: G (2n gated, else n).
        dtype_bytes: D_t, bytes per activation element.
        device_type: the activations' device type (used when ``block_bytes`` is None).

    Returns:
        ⌊block_bytes / row bytes⌋, at least 1; for None the device default's rows, at least
        :data:`MIN_BLOCK_ROWS`.

    Raises:
        ValueError: ``block_bytes`` not None and not an int in [1, int64's largest].

    Reference: MoEBlaze §4.2 (tiles of the expert-grouped rows); our sizing.
    """
    row_bytes = block_row_bytes(hidden_size, intermediate_size, up_width, dtype_bytes)
    if block_bytes is None:
        return _default_rows(device_type, row_bytes)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) \
            or not 1 <= block_bytes <= INT64_MAX:
        raise ValueError(f"block_bytes must be None (the device's default) or an int in "
                         f"[1, {INT64_MAX}] bytes, got {block_bytes!r}")
    return max(1, block_bytes // row_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig(RouteOptions):
    """One MoE feed-forward layer: router and routed experts.

    The routing options (``capacity_factor``, ``min_capacity``, ``drop_policy``, ``n_group``,
    ``topk_group``, ``routed_scaling_factor``) are inherited from :class:`RouteOptions` and
    described there; this class adds the rules that tie them to E and k.

    Attributes:
        hidden_size: d, the model width.
        intermediate_size: n, expert intermediate size per GLU branch.
        num_experts: E, routed experts.
        top_k: k, experts per token, in [1, E].
        score_func: ``softmax`` or ``sigmoid`` router scores (computed in fp32).
        renormalize: rescale the k selected scores to sum to 1 per token. Rejected with
            ``top_k=1`` (every weight would be exactly 1.0 and the router would get no gradient
            from the output).
        activation: expert activation, a name of ``memfine.activations.ACTIVATIONS``
            (``swiglu``, ``geglu``: gated, w_up holds 2n columns; ``silu``, ``gelu``, ``relu``,
            ``relu2``).
        experts_impl: ``fused`` (MoEBlaze path, saves x and H) or ``plain`` (autograd over
            gathered/scattered copies).
        gemm_backend: grouped GEMM backend for the expert matmuls.
        index_builder: how the four dispatch index arrays are built.
        aux_loss_coef: weight of the Switch load-balancing loss in the training loss.
        z_loss_coef: weight of the router z-loss in the training loss.
        skew_hot_experts: experiment knob (0 = off): number of "hot" experts, ids
            0..skew_hot_experts-1, that the router's selection bias favours; in [0, num_experts].
        skew_bias: experiment knob: bias added to the hot experts' scores for top-k selection
            only (weights stay unbiased), >= 0. Scores lie in [0, 1], so a bias > 1 with
            ``skew_hot_experts = top_k`` sends every token to experts 0..k-1 (the worst case of
            MemFine's skew); small values skew partially. Used to show chunking under skew on one
            device; leave at 0 for training.
        bias_update_rate: γ of aux-loss-free balancing (DeepSeek-V3 §2.1.2): after each
            optimizer step the selection bias moves by ``γ·sign(mean_load − load_i)``; 0 = off.
        seq_aux_loss_coef: weight α of DeepSeek-V3's sequence-wise balance loss (Eq. 17-20) in
            the training loss, >= 0 (returned as ``MoEAux.sequence_balance_loss``; 0: None).
        router_jitter_eps: ε of Switch Transformer's router input jitter: in training mode the
            router input is multiplied by U(1−ε, 1+ε) (the experts' input is not), in [0, 1).
        num_shared_experts: always-on shared experts added to the routed output (DeepSeek-MoE,
            Qwen2-MoE), >= 0; they run on the same fused, chunked path as the routed experts.
        shared_intermediate_size: n of one shared expert per GLU branch; ``None`` means n.
        shared_expert_gate: scale the shared output by sigmoid(x·w_g) per token (Qwen2-MoE).
        backward_block_bytes: byte target of one row block of the fused experts' streamed
            forward and backward (the backward's dO, dA, A, dH and gathered rows per block;
            :func:`backward_block_rows`), an int from one row at 2 bytes per element
            ((3·d + 3·n + G)·2) to int64's largest (ValueError otherwise). None (default):
            sized from the device the activations are on (:func:`default_block_bytes`): 16 MiB
            on the CPU (within 1% of the fastest size measured there), on CUDA the device's
            memory ÷ 32, at least 512 MiB (one block at the Qwen3-30B-A3B layer at T 16384
            on an H200). Rows per block set the
            forward's and the backward's transients (the memory model's ``fwd.x_BD``,
            ``fwd.H_block``,
            ``fwd.A``, ``fwd.Y`` and ``bwd.*`` items scale with them; it resolves None for
            the device it is given, as the layer does) and the block count (each block is
            one set of kernel launches);
            in bf16 an expert cut by a block edge adds an fp32 (I, O) weight-gradient sum.
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
    skew_hot_experts: int = 0
    skew_bias: float = 0.0
    bias_update_rate: float = 0.0
    seq_aux_loss_coef: float = 0.0
    router_jitter_eps: float = 0.0
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    backward_block_bytes: int | None = None

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        self._check_sizes()
        # n_group ≤ E before RouteOptions' own checks, so the message names the bound
        check_int(self, "n_group", 1, self.num_experts)
        RouteOptions.__post_init__(self)  # slots dataclass: no zero-argument super()
        _check_routing(self)

    def _check_sizes(self) -> None:
        check_int(self, "hidden_size", 1)
        check_int(self, "intermediate_size", 1)
        check_int(self, "num_experts", 1)
        check_int(self, "top_k", 1)
        if not 1 <= self.top_k <= self.num_experts:
            fail(self, "top_k", f"in [1, num_experts={self.num_experts}]", self.top_k)
        check_choice(self, "score_func", ScoreFunc)
        check_choice(self, "activation", Activation)
        check_choice(self, "experts_impl", ExpertsImpl)
        check_choice(self, "gemm_backend", GemmBackend)
        check_choice(self, "index_builder", IndexBuilder)
        if not isinstance(self.renormalize, bool):
            fail(self, "renormalize", "a bool", self.renormalize)
        if self.renormalize and self.top_k == 1:
            fail(self, "renormalize",
                  "False when top_k=1 (renormalised top-1 weights are all 1.0, so the router "
                  "would get no gradient from the output)", self.renormalize)
        check_float(self, "aux_loss_coef", 0.0)
        check_float(self, "z_loss_coef", 0.0)
        check_int(self, "skew_hot_experts", 0, self.num_experts)
        check_float(self, "skew_bias", 0.0)
        if self.skew_bias > 0 and self.skew_hot_experts == 0:
            fail(self, "skew_hot_experts", ">= 1 when skew_bias > 0", self.skew_hot_experts)
        _check_backend_device(self)
        check_block_bytes(self.backward_block_bytes,  # one row at 2 bytes per element
                          block_row_bytes(self.hidden_size, self.intermediate_size,
                                          self.up_width, 2), "MoEConfig.backward_block_bytes")

    @property
    def shared_width(self) -> int:
        """N of one shared expert (``shared_intermediate_size`` or n)."""
        return self.shared_intermediate_size or self.intermediate_size

    def shared_experts_config(self) -> MoEConfig:
        """The config the shared experts run with: E = k = S, n = n_s, no renormalisation.

        Shared experts are a routed layer whose routing is fixed (every token to all S), so
        they reuse the fused, chunked expert path and its memory model unchanged.

        Raises:
            ValueError: if ``num_shared_experts`` is 0.
        """
        S = self.num_shared_experts
        if S < 1:
            fail(self, "num_shared_experts", ">= 1 for a shared-experts config", S)
        return MoEConfig(hidden_size=self.hidden_size, intermediate_size=self.shared_width,
                         num_experts=S, top_k=S, renormalize=False, activation=self.activation,
                         experts_impl=self.experts_impl, gemm_backend=self.gemm_backend,
                         index_builder=self.index_builder,
                         backward_block_bytes=self.backward_block_bytes)

    @property
    def gated(self) -> bool:
        """True for gated activations (w_up has 2n columns)."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def up_width(self) -> int:
        """G: columns of w_up (2n gated, n otherwise)."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size


def _check_backend_device(moe: MoEConfig) -> None:
    """``gemm_backend='triton'`` needs CUDA or ``TRITON_INTERPRET=1`` (Triton's CPU interpreter).

    Raises:
        ValueError: naming ``gemm_backend`` on a machine without CUDA when the interpreter is
            off, so the config fails when it is built, not at the first step.
    """
    if moe.gemm_backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch  # lazily: the config package imports no torch at module level

    if not torch.cuda.is_available():
        fail(moe, "gemm_backend", "'auto', 'grouped_mm' or 'loop' on a machine without CUDA "
             "('triton' runs there only under TRITON_INTERPRET=1, Triton's CPU interpreter)",
             moe.gemm_backend)


def _check_routing(moe: MoEConfig) -> None:
    """Rules tying the routing options to E and k; balancing and shared experts."""
    E = moe.num_experts
    if E % moe.n_group:
        fail(moe, "n_group", f"a divisor of num_experts={E}", moe.n_group)
    if moe.n_group > 1 and E // moe.n_group < 2:
        fail(moe, "n_group", f"at most num_experts/2={E // 2} (a group's score is the sum of "
              "its top-2 scores, so each group needs >= 2 experts)", moe.n_group)
    if moe.topk_group * (E // moe.n_group) < moe.top_k:
        fail(moe, "topk_group", f"large enough that topk_group·num_experts/n_group >= "
              f"top_k={moe.top_k} (n_group={moe.n_group})", moe.topk_group)
    check_float(moe, "bias_update_rate", 0.0)
    check_float(moe, "seq_aux_loss_coef", 0.0)
    check_float(moe, "router_jitter_eps", 0.0)
    if moe.router_jitter_eps >= 1:
        fail(moe, "router_jitter_eps", "in [0, 1)", moe.router_jitter_eps)
    check_int(moe, "num_shared_experts", 0)
    if moe.shared_intermediate_size is not None:
        check_int(moe, "shared_intermediate_size", 1)
    if not isinstance(moe.shared_expert_gate, bool):
        fail(moe, "shared_expert_gate", "a bool", moe.shared_expert_gate)
    if moe.shared_expert_gate and moe.num_shared_experts == 0:
        fail(moe, "shared_expert_gate", "False when num_shared_experts=0",
              moe.shared_expert_gate)

