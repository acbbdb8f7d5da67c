"""Memory of a whole MoE transformer per pipeline stage: MemFine Eq. 1-3, 8 and 9 with bins.

Static memory (Eq. 1, our reading of Megatron mixed precision): per parameter D_t bytes of weights,
``grad_bytes`` of gradients (fp32 main gradients: 4) and ``optimizer_bytes`` of optimizer state
(fp32 master weights + Adam moments: 12), the latter sharded over the data-parallel group with the
distributed optimizer (dense parameters over dp·cp, expert parameters over t·dp·cp/e).

Activations (Eq. 2 and Table 2 as docs/design.md §4 states them), bytes of one layer and
micro-batch, each divided by t·cp; the expert part counts the received rows per micro-batch and
device, s″ = b·s·k·skew/(t·cp), at D_t·(2d + 2n) bytes each. Our additions, by the same rule: a
dense FFN layer D_t·b·s·(2d + 2n_dense), shared experts D_t·b·s·n_shared·(2d + 2n_shared), and
the layer input D_t·b·s·d that full recomputation keeps.
In-flight model chunks m_g: p − r for the 1F1B schedule (v = 1), v·p + p − 2r − 1 interleaved.

Recompute modes: ``none`` keeps every layer of the m_g in-flight chunks (chunking cannot help);
``full`` keeps the layer inputs and recomputes one layer at a time (MemFine: m_g = 1 for the
recomputed layer), its expert part in c chunks; ``experts`` keeps the attention part of every
in-flight layer and recomputes the expert part one chunk at a time.
Eq. 8: s′_max = ⌊(α·M − M_sta − F)/R⌋ (F, R: :func:`activation_split`); Eq. 9: ⌈s″/s′_max⌉ binned.

Reference: MemFine (arXiv 2511.21431) Eq. 1-3, 8, 9, Table 2; docs/design.md §4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from memfine.config import MoEConfig
from memfine.memory.layer import expert_row_bytes
from memfine.memory.planner import choose_num_chunks, s_prime_max
from memfine.plan.layout import PlanConfig, in_flight_chunks, stage_layers


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticMemory:
    """Eq. 1 bytes of one pipeline rank (every field an int)."""

    dense_params: int
    expert_params: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    static_bytes: int


def static_memory(cfg: PlanConfig, rank: int) -> StaticMemory:
    """Parameters, gradients and optimizer state of pipeline rank ``rank`` (MemFine Eq. 1).

    Dense parameters (attention, norms, dense FFN, shared experts) are split over t; routed
    experts over e (expert tensor parallel 1); the router is replicated; the input embedding sits
    on the first rank and the output head (or the tied copy) on the last.
    """
    m, t = cfg.model, cfg.t
    d = m.hidden_size
    dense = expert = 0
    for layer in (i for chunk in stage_layers(m.num_layers, cfg.p, cfg.v)[rank] for i in chunk):
        dense += m.attention_params // t + 2 * d
        if layer < m.num_dense_layers:
            dense += 3 * d * m.dense_intermediate_size // t
        else:
            dense += m.num_experts * d  # router
            dense += m.num_shared_experts * 3 * d * m.shared_intermediate_size // t
            expert += cfg.local_experts * 3 * d * m.moe_intermediate_size
    if rank == 0:
        dense += m.vocab_size * d // t
    if rank == cfg.p - 1:
        dense += m.vocab_size * d // t + d  # output head (a tied copy too) + final norm
    n = dense + expert
    opt = cfg.optimizer_bytes
    if cfg.distributed_optimizer:
        opt_bytes = (opt * dense) // (cfg.dp * cfg.cp) + (opt * expert * cfg.e) // (
            t * cfg.dp * cfg.cp)
    else:
        opt_bytes = opt * n
    param_bytes, grad_bytes = n * cfg.dtype_bytes, n * cfg.grad_bytes
    return StaticMemory(dense_params=dense, expert_params=expert, parameter_bytes=param_bytes,
                        gradient_bytes=grad_bytes, optimizer_state_bytes=opt_bytes,
                        static_bytes=param_bytes + grad_bytes + opt_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerActivation:
    """Eq. 2 bytes of one layer and micro-batch on one rank (each already divided by t·cp)."""

    attention_bytes: int = field(metadata={"source": "MemFine Table 2: 5d + a·h_d + 2·k_a·h_d + E"})
    shared_expert_bytes: int = field(metadata={"source": "our analogy: n_sh·(2d + 2n_sh)"})
    dense_ffn_bytes: int = field(metadata={"source": "our analogy: 2d + 2n_dense"})
    layer_input_bytes: int = field(metadata={"source": "our addition: d (full recompute)"})
    expert_row_bytes: int = field(metadata={"source": "MemFine Table 2: 2d + 2n per row"})


def _scaled(cfg: PlanConfig, width: int, tokens: int) -> int:
    """⌈D_t·b·tokens·width / (t·cp)⌉ bytes."""
    return -(-cfg.dtype_bytes * cfg.micro_batch * tokens * width // (cfg.t * cfg.cp))


def layer_activation(cfg: PlanConfig, *, moe_layer: bool) -> LayerActivation:
    """Activation bytes of one dense or MoE layer and micro-batch (expert part per row).

    ``expert_row_bytes`` is per received row on this rank (``paper``: D_t·(2d + 2n), MemFine
    Table 2; ``memfine``: our fused path's peak per row); the rows themselves
    (:func:`recv_rows`) count the micro-batch and the t·cp split.
    """
    m, s = cfg.model, cfg.seq_len
    d, hd = m.hidden_size, m.head_dim
    attn_width = 5 * d + m.num_heads * hd + 2 * m.num_kv_heads * hd + (
        m.num_experts if moe_layer else 0)
    shared = m.num_shared_experts * (2 * d + 2 * m.shared_intermediate_size)
    if cfg.expert_model == "memfine":
        local = MoEConfig(hidden_size=d, intermediate_size=m.moe_intermediate_size,
                          num_experts=cfg.local_experts, top_k=m.top_k,
                          renormalize=m.top_k > 1)
        rec = "experts" if cfg.recompute == "none" else cfg.recompute
        row = expert_row_bytes(local, cfg.dtype_bytes, recompute=rec)
    else:
        row = cfg.dtype_bytes * (2 * d + 2 * m.moe_intermediate_size)
    return LayerActivation(
        attention_bytes=_scaled(cfg, attn_width, s),
        shared_expert_bytes=_scaled(cfg, shared, s) if moe_layer else 0,
        dense_ffn_bytes=0 if moe_layer else _scaled(cfg, 2 * d + 2 * m.dense_intermediate_size,
                                                     s),
        layer_input_bytes=_scaled(cfg, d, s),
        expert_row_bytes=row if moe_layer else 0,
    )


def activation_split(cfg: PlanConfig, rank: int) -> tuple[int, int, int]:
    """(F, R, floor) in bytes: the activation model of pipeline rank ``rank``.

    At s′ received rows (per micro-batch, :func:`recv_rows`) and c chunks the activation is
    max(floor, F + R·⌈s′/c⌉) (recompute ``full``/``experts``) or F + R·s′ (``none``).

    F does not scale with s′; R is bytes per received row (for ``none`` summed over every
    in-flight MoE layer); ``floor`` is the activation while a dense layer is recomputed (``full``),
    else 0.
    """
    chunks = stage_layers(cfg.model.num_layers, cfg.p, cfg.v)[rank]
    m_g = in_flight_chunks(cfg.p, cfg.v, rank)
    dense_l, moe_l = (layer_activation(cfg, moe_layer=f) for f in (False, True))
    per = [[moe_l if i >= cfg.model.num_dense_layers else dense_l for i in ch] for ch in chunks]

    def kept(a: LayerActivation) -> int:
        return a.attention_bytes + a.dense_ffn_bytes + a.shared_expert_bytes

    biggest = max(per, key=lambda ch: sum(kept(a) for a in ch))
    moe_here = any(a.expert_row_bytes for ch in per for a in ch)
    row = moe_l.expert_row_bytes if moe_here else 0
    if cfg.recompute == "none":
        n_moe = sum(1 for a in biggest if a.expert_row_bytes)
        return m_g * sum(kept(a) for a in biggest), m_g * n_moe * row, 0
    if cfg.recompute == "experts":
        return m_g * sum(kept(a) for a in biggest), row, 0
    ckpt = m_g * sum(a.layer_input_bytes for a in biggest)
    dense_here = any(not a.expert_row_bytes for ch in per for a in ch)
    floor = ckpt + kept(dense_l) if dense_here else 0
    return (ckpt + kept(moe_l) if moe_here else floor), row, floor


def recv_rows(cfg: PlanConfig, skew: float) -> int:
    """s″: rows one micro-batch sends to this device's experts at a skew (capped at the worst).

    ⌈b·s·k·skew / (t·cp)⌉: the balanced share is b·s·k rows per micro-batch, split over t·cp.
    """
    balanced = cfg.micro_batch * cfg.seq_len * cfg.model.top_k
    return math.ceil(balanced * min(skew, cfg.worst_skew) / (cfg.t * cfg.cp))


@dataclass(frozen=True, kw_only=True, slots=True)
class SkewPlan:
    """One pipeline stage at one routing skew: what MACT picks and what it costs (bytes as ints).

    Attributes:
        skew: received rows as a multiple of the balanced share (capped at the worst case).
        recv_rows: s″, rows this device's experts receive per micro-batch (0: no MoE layer).
        chunks_needed: ⌈s″/s′_max⌉ (MemFine Eq. 9); ``None`` when no MoE layer is on the stage
            or s′_max = 0 (the part that does not scale with s″ alone exceeds the budget).
        num_chunks: MACT's bin (the smallest bin ≥ ``chunks_needed``); ``None`` when no bin is
            large enough or no MoE layer is on the stage.
        activation_bytes: activation at ``num_chunks`` (the largest bin when none fits).
        activation_unchunked_bytes: activation at c = 1.
        activation_max_chunks_bytes: activation at the largest bin.
        total_bytes: static + ``activation_bytes``.
        fits: total within α·M_device.
        min_device_memory_bytes: least M_device that holds this skew at the largest bin
            (MemFine Eq. 3: (static + activation)/α).
    """

    skew: float
    recv_rows: int
    chunks_needed: int | None
    num_chunks: int | None
    activation_bytes: int
    activation_unchunked_bytes: int
    activation_max_chunks_bytes: int
    total_bytes: int
    fits: bool
    min_device_memory_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """The memory plan of one pipeline rank (bytes as ints; MemFine Eq. 1-3, 8, 9).

    Attributes:
        rank: pipeline rank r.
        layers: the layer ids it runs.
        in_flight: m_g, model chunks whose activations it holds at once.
        static: Eq. 1 items of this rank.
        static_bytes: static memory used (Eq. 1, or the measured value given).
        budget_bytes: α·M_device.
        fixed_activation_bytes: activation that does not scale with s″ (F).
        floor_activation_bytes: activation while a dense layer is recomputed (``full``), else 0.
        row_bytes: bytes per received row (R; 0 on a stage without MoE layers).
        s_prime_max: Eq. 8, the most received rows one chunk may hold (≥ 0); ``None`` on a
            stage without MoE layers.
        skews: one :class:`SkewPlan` per requested skew.
    """

    rank: int
    layers: tuple[int, ...]
    in_flight: int
    static: StaticMemory
    static_bytes: int
    budget_bytes: int
    fixed_activation_bytes: int
    floor_activation_bytes: int
    row_bytes: int
    s_prime_max: int | None
    skews: tuple[SkewPlan, ...]

    @property
    def worst(self) -> SkewPlan:
        """The skew with the largest total bytes (the highest skew among equals)."""
        return max(self.skews, key=lambda sk: (sk.total_bytes, sk.skew))


def _skew_plan(cfg: PlanConfig, skew: float, static: int, split: tuple[int, int, int],
               s_max: int | None) -> SkewPlan:
    """Eq. 9 and the activation of one stage at one skew (``split`` = (F, R, floor))."""
    fixed, row, floor = split
    bins = cfg.bins if cfg.recompute != "none" else (1,)
    budget = int(cfg.alpha * cfg.device_memory_bytes)

    def act(rows: int, c: int) -> int:
        return max(floor, fixed + row * math.ceil(rows / c))

    rows = recv_rows(cfg, skew) if row else 0
    needed = c = None
    if s_max is not None:
        choice = choose_num_chunks(rows, s_max, bins)
        needed, c = choice.chunks_needed, choice.num_chunks
    at_c = act(rows, c or bins[-1])
    at_max = act(rows, bins[-1])
    return SkewPlan(
        skew=skew, recv_rows=rows, chunks_needed=needed, num_chunks=c, activation_bytes=at_c,
        activation_unchunked_bytes=act(rows, 1), activation_max_chunks_bytes=at_max,
        total_bytes=static + at_c, fits=static + at_c <= budget,
        min_device_memory_bytes=math.ceil((static + at_max) / cfg.alpha))  # Eq. 3


def plan_stage(cfg: PlanConfig, rank: int) -> StagePlan:
    """The plan of one pipeline rank: static, activation split, s′_max and c per skew.

    Raises:
        ValueError: if rank is outside [0, p).

    Reference: MemFine Eq. 1-3 (static, activation, fit), Eq. 8 (s′_max), Eq. 9 (c).
    """
    if not 0 <= rank < cfg.p:
        raise ValueError(f"rank must be in [0, p={cfg.p}), got {rank}")
    st = static_memory(cfg, rank)
    static = st.static_bytes if cfg.static_bytes is None else cfg.static_bytes
    split = activation_split(cfg, rank)
    fixed, row, floor = split
    budget = int(cfg.alpha * cfg.device_memory_bytes)
    s_max = None
    if row:  # Eq. 8; 0 when even the floor (a recomputed dense layer) is over budget
        s_max = max(0, s_prime_max(budget, static + fixed, row))
        s_max = 0 if static + floor > budget else s_max
    layers = tuple(i for ch in stage_layers(cfg.model.num_layers, cfg.p, cfg.v)[rank]
                   for i in ch)
    return StagePlan(
        rank=rank, layers=layers, in_flight=in_flight_chunks(cfg.p, cfg.v, rank), static=st,
        static_bytes=static, budget_bytes=budget, fixed_activation_bytes=fixed,
        floor_activation_bytes=floor, row_bytes=row, s_prime_max=s_max,
        skews=tuple(_skew_plan(cfg, sk, static, split, s_max) for sk in cfg.skews))


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The plan of every pipeline rank of one layout.

    Attributes:
        config: the layout planned.
        stages: one :class:`StagePlan` per pipeline rank.
    """

    config: PlanConfig
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool:
        """True when every stage fits at every skew."""
        return all(sk.fits for st in self.stages for sk in st.skews)

    @property
    def limiting(self) -> tuple[StagePlan, SkewPlan]:
        """The stage and skew with the largest total bytes per device."""
        return max(((st, st.worst) for st in self.stages), key=lambda x: x[1].total_bytes)

    @property
    def peak_bytes(self) -> int:
        """Largest total bytes per device (static + activation at MACT's c)."""
        return self.limiting[1].total_bytes

    @property
    def min_device_memory_bytes(self) -> int:
        """Least M_device that holds every stage at every skew (largest bin), bytes."""
        return max(sk.min_device_memory_bytes for st in self.stages for sk in st.skews)


def plan_layout(cfg: PlanConfig) -> Plan:
    """:func:`plan_stage` of every pipeline rank.

    Ranks with the same layer count, in-flight count and embedding placement give the same
    plan; each distinct one is computed once.
    """
    seen: dict[tuple[object, ...], StagePlan] = {}
    stages = []
    for rank in range(cfg.p):
        layers = [i for ch in stage_layers(cfg.model.num_layers, cfg.p, cfg.v)[rank] for i in ch]
        dense = sum(1 for i in layers if i < cfg.model.num_dense_layers)
        key = (len(layers), dense, in_flight_chunks(cfg.p, cfg.v, rank), rank == 0,
               rank == cfg.p - 1, cfg.v)
        if key not in seen or cfg.v > 1:
            seen[key] = plan_stage(cfg, rank)
            stages.append(seen[key])
        else:
            stages.append(replace(seen[key], rank=rank, layers=tuple(layers)))
    return Plan(config=cfg, stages=tuple(stages))
