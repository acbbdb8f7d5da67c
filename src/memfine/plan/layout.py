"""A parallel layout of an MoE transformer: the plan's inputs and the pipeline's layer placement.

:class:`PlanConfig` holds a model (:class:`memfine.plan.presets.ModelPreset`), the device
memory and one layout (t, p, e, dp, cp, v, b, s, recompute, bins: its attributes);
:func:`stage_layers` places the layers on pipeline ranks; :func:`in_flight_chunks` is m_g.

Reference: MemFine (arXiv 2511.21431) Eq. 2 (m_g), §5; Megatron-LM's interleaved schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfine._checks import check_bins, check_choice, check_float, check_int, fail
from memfine.config import MAX_BIN, RECOMPUTE_MODES, RecomputeMode
from memfine.plan.presets import ModelPreset
from memfine.units import DTYPE_BYTES, GiB

EXPERT_MODELS = ("paper", "memfine")


def seq_len_divisor(t: int, cp: int) -> int:
    """What s must be a multiple of under t-way sequence and cp-way context parallelism.

    t·(2·cp if cp > 1 else 1): sequence parallelism (on with tensor parallelism, as the plan's
    activation model assumes: activations split over t·cp) splits s over t ranks; context
    parallelism cuts it into 2·cp pieces for load balance. Reference: torchtitan's trainer
    (the "sequence/context parallelism" evenness check).
    """
    return t * (2 * cp if cp > 1 else 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """Everything ``memfine plan`` needs (plain values; validated on construction).

    Attributes:
        model: the model sizes.
        device_memory_bytes: M_device, bytes per device (default 80 GiB).
        alpha: usable fraction α of device memory, in (0, 1].
        micro_batch: b, sequences per micro-batch.
        seq_len: s, tokens per sequence.
        dtype: ``bfloat16``, ``float16`` or ``float32`` (D_t).
        recompute: ``full``, ``experts`` or ``none``.
        t, p, e, dp, cp, v: tensor-, pipeline-, expert-, data-, context-parallel sizes and virtual
            stages per pipeline rank; t divides the attention heads, e divides E and t·dp·cp,
            s is a multiple of :func:`seq_len_divisor` (t, cp).
        skews: received rows as multiples of the balanced share s·k (≥ 1); capped at the worst
            case e·min(k, E/e)/k.
        bins: allowed chunk counts, strictly increasing ints in [1, 16].
        grad_bytes: gradient bytes per parameter (4: fp32 main gradients).
        optimizer_bytes: optimizer bytes per parameter (12: fp32 master + two Adam moments).
        distributed_optimizer: shard optimizer state over the data-parallel group.
        static_bytes: measured static memory to use instead of Eq. 1 (``None``: Eq. 1).
        expert_model: ``paper`` (Table 2: D_t·(2d + 2n) per row) or ``memfine`` (our fused
            path's peak per row, :func:`memfine.memory.layer.expert_row_bytes`).
        global_batch: sequences per optimizer step (for the pipeline bubble), or ``None``.
    """

    model: ModelPreset
    device_memory_bytes: int = 80 * GiB
    alpha: float = 0.9
    micro_batch: int = 1
    seq_len: int = 4096
    dtype: str = "bfloat16"
    recompute: RecomputeMode = "full"
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
    global_batch: int | None = None

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
            fail(self, "skews", "a non-empty tuple of numbers >= 1", self.skews,
                 "numbers >= 1")
        object.__setattr__(self, "bins", check_bins(self, hi=MAX_BIN))
        m = self.model
        if m.num_heads % self.t:  # tensor parallelism splits the attention heads
            fail(self, "t", f"a divisor of num_heads={m.num_heads}", self.t)
        if m.num_experts % self.e:
            fail(self, "e", f"a divisor of num_experts={m.num_experts}", self.e)
        if (self.t * self.dp * self.cp) % self.e:
            fail(self, "e", f"a divisor of t·dp·cp={self.t * self.dp * self.cp}", self.e)
        if self.seq_len % seq_len_divisor(self.t, self.cp):
            fail(self, "seq_len", f"a multiple of t·(2·cp if cp > 1 else 1)="
                 f"{seq_len_divisor(self.t, self.cp)} (sequence parallelism splits s over t, "
                 "context parallelism into 2·cp load-balanced pieces)", self.seq_len)
        if self.v > 1 and self.p == 1:
            fail(self, "v", "1 when p = 1 (virtual stages interleave a pipeline of p >= 2 ranks)",
                 self.v)
        if m.num_layers < self.p * self.v:
            fail(self, "p", f"with v such that p·v <= num_layers={m.num_layers}", self.p)
        check_int(self, "grad_bytes", 0)
        check_int(self, "optimizer_bytes", 0)
        if self.static_bytes is not None:
            check_int(self, "static_bytes", 0)
        if self.global_batch is not None:
            check_int(self, "global_batch", 1)
            if self.global_batch % (self.dp * self.micro_batch):
                fail(self, "global_batch", f"a multiple of dp·micro_batch="
                     f"{self.dp * self.micro_batch}", self.global_batch)

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

    @property
    def devices(self) -> int:
        """N = t·p·dp·cp (experts are sharded inside t·dp·cp)."""
        return self.t * self.p * self.dp * self.cp

    @property
    def micro_batches(self) -> int | None:
        """m, micro-batches per pipeline per step: global_batch / (dp·b); ``None`` if unknown."""
        if self.global_batch is None:
            return None
        return self.global_batch // (self.dp * self.micro_batch)


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
