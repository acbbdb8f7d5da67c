"""Memory of a whole MoE transformer per pipeline stage: MemFine Eq. 1-3, 8 and 9 with bins.

Static memory (Eq. 1, our reading of Megatron mixed precision): per parameter D_t bytes of weights,
``grad_bytes`` of gradients (fp32 main gradients: 4) and ``optimizer_bytes`` of optimizer state
(fp32 master weights + Adam moments: 12), the latter sharded over the data-parallel group with the
distributed optimizer (dense parameters over dp·cp, expert parameters over t·dp·cp/e).

Activations (Eq. 2, MemFine Table 2), bytes of one layer and micro-batch, each divided by t·cp:
attention/router part D_t·b·s·(5d + a·h_d + 2·k_a·h_d + E) and expert part D_t·b·s′·(2d + 2n),
with s′ the rows one sequence sends to this rank's experts (s·k when balanced). Our additions,
by the same rule: a dense FFN layer D_t·b·s·(2d + 2n_dense), shared experts
D_t·b·s·n_shared·(2d + 2n_shared), and the layer input D_t·b·s·d that full recomputation keeps.
In-flight model chunks m_g: p − r for the 1F1B schedule (v = 1), v·p + p − 2r − 1 interleaved.

Recompute modes: ``none`` keeps every layer of the m_g in-flight chunks (chunking cannot help);
``full`` keeps the layer inputs and recomputes one layer at a time (MemFine: m_g = 1 for the
recomputed layer), its expert part in c chunks; ``experts`` keeps the attention part of every
in-flight layer and recomputes the expert part one chunk at a time.
Eq. 8: s′_max = ⌊(α·M − M_sta − F)/R⌋ with F the activation that does not scale with s′ and R the
bytes per received row; Eq. 9: c = ⌈s″/s′_max⌉ rounded up to the bins.

Reference: MemFine (arXiv 2511.21431) Eq. 1-3, 8, 9, Table 2; docs/design.md §4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memfine._checks import check_bins, check_choice, check_float, check_int, fail
from memfine.config import MoEConfig
from memfine.memory.layer import expert_row_bytes
from memfine.memory.planner import s_prime_max
from memfine.memory.presets import ModelPreset
from memfine.units import DTYPE_BYTES

RECOMPUTE_MODES = ("none", "full", "experts")
EXPERT_MODELS = ("paper", "memfine")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """Everything ``memfine plan`` needs (plain values; validated on construction).

    Attributes:
        model: the model sizes.
        device_memory_bytes: M_device, bytes per device.
        alpha: usable fraction α of device memory, in (0, 1].
        micro_batch: b, sequences per micro-batch.
        seq_len: s, tokens per sequence.
        dtype: ``bfloat16``, ``float16`` or ``float32`` (D_t).
        recompute: ``full``, ``experts`` or ``none``.
        t, p, e, dp, cp, v: tensor-, pipeline-, expert-, data-, context-parallel sizes and virtual
            stages per pipeline rank.
        skews: received rows as multiples of the balanced share s·k (≥ 1); capped at the worst
            case e·min(k, E/e)/k.
        bins: allowed chunk counts, strictly increasing, starting at 1 or more.
        grad_bytes: gradient bytes per parameter (4: fp32 main gradients).
        optimizer_bytes: optimizer bytes per parameter (12: fp32 master + two Adam moments).
        distributed_optimizer: shard optimizer state over the data-parallel group.
        static_bytes: measured static memory to use instead of Eq. 1 (``None``: Eq. 1).
        expert_model: ``paper`` (Table 2: D_t·(2d + 2n) per row) or ``memfine`` (our fused
            path's peak per row, :func:`memfine.memory.layer.expert_row_bytes`).
    """

    model: ModelPreset
    device_memory_bytes: int
    alpha: float = 0.9
    micro_batch: int = 1
    seq_len: int = 4096
    dtype: str = "bfloat16"
    recompute: str = "full"
    t: int = 1
    p: int = 1
    e: int = 1
    dp: int = 1
    cp: int = 1
    v: int = 1
    skews: tuple[float, ...] = (1.0,)
    bins: tuple[int, ...] = (1, 2, 4, 8)
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    distributed_optimizer: bool = True
    static_bytes: int | None = None
    expert_model: str = "paper"

    def __post_init__(self) -> None:
        """Validate every field and cross-field rule, and store ``bins`` as a tuple.

        Raises:
            ValueError: naming the class and field, what is allowed and the value received.
        """
        for name in ("device_memory_bytes", "micro_batch", "seq_len", "t", "p", "e", "dp", "cp",
                     "v"):
            check_int(self, name, 1)
        check_float(self, "alpha", 0, 1, lo_open=True)
        check_choice(self, "dtype", tuple(DTYPE_BYTES))
        check_choice(self, "recompute", RECOMPUTE_MODES)
        check_choice(self, "expert_model", EXPERT_MODELS)
        if not self.skews or any(not (isinstance(x, (int, float)) and x >= 1) for x in self.skews):
            fail(self, "skews", "a non-empty tuple of numbers >= 1", self.skews)
        object.__setattr__(self, "bins", check_bins(self))
        m = self.model
        if not 1 <= m.top_k <= m.num_experts:
            raise ValueError(f"{type(self).__name__}.model.top_k must be in "
                             f"[1, num_experts={m.num_experts}], got {m.top_k}")
        if m.num_experts % self.e:
            fail(self, "e", f"a divisor of num_experts={m.num_experts}", self.e)
        if (self.t * self.dp * self.cp) % self.e:
            fail(self, "e", f"a divisor of t·dp·cp={self.t * self.dp * self.cp}", self.e)
        if m.num_layers < self.p * self.v:
            fail(self, "p", f"with v such that p·v <= num_layers={m.num_layers}", self.p)
        check_int(self, "grad_bytes", 0)
        check_int(self, "optimizer_bytes", 0)
        if self.static_bytes is not None:
            check_int(self, "static_bytes", 0)

    @property
    def dtype_bytes(self) -> int:
        """D_t."""
        return DTYPE_BYTES[self.dtype]

    @property
    def local_experts(self) -> int:
        """E/e, routed experts per rank."""
        return self.model.num_experts // self.e

    @property
    def worst_skew(self) -> float:
        """Largest possible received rows / balanced share: e·min(k, E/e)/k."""
        return self.e * min(self.model.top_k, self.local_experts) / self.model.top_k


def stage_layers(num_layers: int, p: int, v: int) -> list[list[list[int]]]:
    """Layer ids of each pipeline rank, per model chunk: ``out[rank][chunk] = [layer ids]``.

    The L layers form p·v consecutive model chunks (the first L mod p·v one layer longer);
    chunk j runs on rank j mod p (Megatron's interleaved assignment; v = 1 is plain 1F1B).
    """
    n = p * v
    base, extra = divmod(num_layers, n)
    chunks, start = [], 0
    for j in range(n):
        size = base + (1 if j < extra else 0)
        chunks.append(list(range(start, start + size)))
        start += size
    return [[chunks[j] for j in range(r, n, p)] for r in range(p)]


def in_flight_chunks(p: int, v: int, rank: int) -> int:
    """m_g: model chunks whose activations a pipeline rank holds at once (MemFine Eq. 2).

    1F1B (v = 1): p − r; interleaved (v > 1): v·p + p − 2r − 1 (Megatron's warm-up count + 1).
    """
    return p - rank if v == 1 else v * p + p - 2 * rank - 1


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
    """Activation bytes of one dense or MoE layer (expert part per row of one sequence).

    ``expert_row_bytes`` is per received row of the micro-batch on this rank
    (``paper``: D_t·(2d + 2n)·b/(t·cp) per sequence-row; ``memfine``: our fused path's peak).
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
        row = -(-expert_row_bytes(local, cfg.dtype_bytes, recompute=rec) * cfg.micro_batch
                // (cfg.t * cfg.cp))
    else:
        row = _scaled(cfg, 2 * d + 2 * m.moe_intermediate_size, 1)
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

    At s′ rows per sequence and c chunks the activation is max(floor, F + R·⌈s′/c⌉) (recompute
    ``full``/``experts``) or F + R·s′ (``none``).

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
    """s″: rows one sequence sends to this rank's experts at a skew (capped at the worst case)."""
    balanced = cfg.seq_len * cfg.model.top_k
    return math.ceil(balanced * min(skew, cfg.worst_skew))


def smallest_device_memory(static: int, activation: int, alpha: float) -> int:
    """Least M_device with M_sta + M_act ≤ α·M_device (MemFine Eq. 3), bytes."""
    return math.ceil((static + activation) / alpha)


def plan_stage(cfg: PlanConfig, rank: int) -> dict[str, object]:
    """The plan of one pipeline rank: static, activation items, s′_max and c per skew.

    Returns:
        A JSON-ready dict (bytes as ints; ``num_chunks`` ``None`` where no bin fits).
    """
    st = static_memory(cfg, rank)
    static = st.static_bytes if cfg.static_bytes is None else cfg.static_bytes
    fixed, row, floor = activation_split(cfg, rank)
    budget = int(cfg.alpha * cfg.device_memory_bytes)
    s_max = None
    if row:
        s_max = s_prime_max(budget, static + fixed, row)
        if static + floor > budget:
            s_max = min(s_max, 0)
    chunked = cfg.recompute != "none"
    bins = cfg.bins if chunked else (1,)

    def act(rows: int, c: int) -> int:
        return max(floor, fixed + row * math.ceil(rows / c))

    per_skew = []
    for skew in cfg.skews:
        rows = recv_rows(cfg, skew) if row else 0
        needed: int | None = 1
        if s_max is not None:
            needed = max(1, math.ceil(rows / s_max)) if s_max > 0 else None
        c = None if needed is None else next((b for b in bins if b >= needed), None)
        if static + floor > budget:
            c = None
        at_c = act(rows, c or bins[-1])
        per_skew.append({
            "skew": skew, "recv_rows": rows, "chunks_needed": needed, "num_chunks": c,
            "activation_bytes": at_c, "activation_unchunked_bytes": act(rows, 1),
            "activation_max_chunks_bytes": act(rows, bins[-1]), "total_bytes": static + at_c,
            "fits": c is not None,
            "min_device_memory_bytes": smallest_device_memory(static, act(rows, bins[-1]),
                                                              cfg.alpha),
        })
    return {
        "rank": rank, "layers": [i for ch in stage_layers(cfg.model.num_layers, cfg.p,
                                                          cfg.v)[rank] for i in ch],
        "in_flight_chunks": in_flight_chunks(cfg.p, cfg.v, rank),
        "dense_params": st.dense_params, "expert_params": st.expert_params,
        "parameter_bytes": st.parameter_bytes, "gradient_bytes": st.gradient_bytes,
        "optimizer_state_bytes": st.optimizer_state_bytes, "eq1_static_bytes": st.static_bytes,
        "static_bytes": static, "budget_bytes": budget, "fixed_activation_bytes": fixed,
        "floor_activation_bytes": floor, "row_bytes": row, "s_prime_max": s_max,
        "skews": per_skew,
    }
