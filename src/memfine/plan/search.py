"""Which layout fits: enumerate the valid layouts on N devices, plan each, rank those that fit.

A layout is (t, p, e, dp, cp, b, recompute, bins) with v = 1 (1F1B) and expert tensor
parallelism 1 (as Megatron-Core); which are valid, the cost (1 + r)·(m + p − 1)/m (lower is
better; :func:`layout_cost`), :data:`RANK_RULE` and the merging of layouts that differ only in
unused bins are explained in docs/plan.md (``--search``). Each layout is planned at the worst
routing skew e·min(k, E/e)/k (:mod:`memfine.plan.stage`) and kept when every stage fits.

Reference: MemFine Eq. 1-3, 8, 9; Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (2021), §2.2 (1F1B bubble) and §3.5 (FLOPs, recomputation).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from memfine.config import RECOMPUTE_MODES
from memfine.plan.layout import PlanConfig, seq_len_divisor
from memfine.plan.presets import ModelPreset
from memfine.plan.stage import Plan, plan_layout

TENSOR_PARALLEL = (1, 2, 4, 8)
CONTEXT_PARALLEL = (1, 2)
MICRO_BATCHES = (1, 2, 4)
BINS = ((1, 2, 4, 8), (1, 2, 4, 8, 16))
MAX_DEVICES_FACTOR = 1 << 12  # the smallest-N search stops at N · 4096
RANK_RULE = ("ranked by relative time to 3 decimals; ties: fewest kinds of parallelism "
             "(t, p, e, dp, cp above 1), then least peak memory")
"""How :func:`search` orders the layouts that fit (printed with them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cost:
    """The ranking cost of one layout (dimensionless).

    Attributes:
        recompute_fraction: r, recomputed FLOPs over the step's forward + backward FLOPs.
        bubble_fraction: (p − 1)/(m + p − 1) of the 1F1B schedule.
        relative_time: (1 + r)/(1 − bubble fraction) = (1 + r)·(m + p − 1)/m.
    """

    recompute_fraction: float
    bubble_fraction: float
    relative_time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One planned layout and its cost."""

    plan: Plan
    cost: Cost


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The layouts on N devices that fit, ranked, and what would fit when none does.

    Attributes:
        fitting: the layouts that fit, best first (:data:`RANK_RULE`), merged.
        considered: how many valid layouts were planned.
        merged: layouts left out of ``fitting`` as the same plan with more (unused) bins.
        smallest_device_memory_bytes: when none fits, the least M_device that fits some layout
            on these N devices (else ``None``).
        smallest_devices: when none fits, the least N·2^j (j ≥ 1) on which some layout fits in
            the given memory (``full`` recompute, b = 1, the largest bins), or ``None`` when
            none does up to N·4096 or when a layout fits.
    """

    fitting: tuple[Candidate, ...]
    considered: int
    merged: int
    smallest_device_memory_bytes: int | None
    smallest_devices: int | None


def forward_flops_per_token(model: ModelPreset, seq_len: int) -> tuple[int, int, int]:
    """(all layers, routed experts, output head) forward FLOPs per token.

    2 FLOPs per multiply-add: attention projections 2·params, causal attention 2·s·a·h_d,
    router 2·d·E, routed experts 2·k·3·d·n (SwiGLU), shared experts 2·3·d·n_sh each, dense
    FFN 2·3·d·n_dense, output head 2·d·V.
    """
    m, d = model, model.hidden_size
    attention = 2 * m.attention_params + 2 * seq_len * m.num_heads * m.head_dim
    experts = 2 * m.top_k * 3 * d * m.moe_intermediate_size
    moe = (attention + 2 * d * m.num_experts + experts
           + 2 * m.num_shared_experts * 3 * d * m.shared_intermediate_size)
    dense = attention + 2 * 3 * d * m.dense_intermediate_size
    layers = m.num_dense_layers * dense + m.num_moe_layers * moe
    return layers, m.num_moe_layers * experts, 2 * d * m.vocab_size


def layout_cost(cfg: PlanConfig) -> Cost:
    """The ranking cost of one layout: relative time per step, communication not modelled.

    r = recomputed forward FLOPs / (3 × forward FLOPs): every layer's forward under ``full``, the
    routed experts' forward under ``experts``, 0 under ``none``. m = global batch / (dp·b)
    micro-batches, p·4 when no global batch is set.

    Reference: Megatron-LM (Narayanan et al. 2021) §2.2: 1F1B bubble (p − 1)/m of the ideal.
    """
    layers, experts, head = forward_flops_per_token(cfg.model, cfg.seq_len)
    extra = {"none": 0, "experts": experts, "full": layers}[cfg.recompute]
    r = extra / (3 * (layers + head))
    m = cfg.micro_batches or 4 * cfg.p
    bubble = (cfg.p - 1) / (m + cfg.p - 1)
    return Cost(recompute_fraction=r, bubble_fraction=bubble,
                relative_time=(1 + r) * (m + cfg.p - 1) / m)


def _divisors(n: int, most: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``most`` (all when None), ascending; O(min(most, √n)) steps."""
    most = n if most is None else min(n, most)
    root = math.isqrt(n)
    small = [i for i in range(1, min(root, most) + 1) if n % i == 0]
    large = [n // i for i in reversed(small) if root < n // i <= most]
    return small + large


def _sizes(base: PlanConfig, devices: int | None = None) -> Iterator[tuple[int, int]]:
    """Every (t, cp) the model and s allow (dividing ``devices`` when given)."""
    m = base.model
    for t in TENSOR_PARALLEL:
        if m.num_heads % t == 0 and (devices is None or devices % t == 0):
            for cp in CONTEXT_PARALLEL:
                if (base.seq_len % seq_len_divisor(t, cp) == 0
                        and (devices is None or devices % (t * cp) == 0)):
                    yield t, cp


def _shapes(base: PlanConfig, devices: int) -> Iterator[PlanConfig]:
    """Every valid (t, cp, p, dp, e) on ``devices``, other fields from ``base``."""
    m = base.model
    for t, cp in _sizes(base, devices):
        rest = devices // (t * cp)
        for p in _divisors(rest, m.num_layers):
            dp = rest // p
            if base.global_batch is not None and base.global_batch % dp:
                continue  # no micro-batch size b makes dp·b divide the global batch
            for e in (e for e in _divisors(m.num_experts) if (t * dp * cp) % e == 0):
                yield replace(base, t=t, cp=cp, p=p, dp=dp, e=e, v=1)


def layouts(base: PlanConfig, devices: int) -> Iterator[PlanConfig]:
    """Every valid layout on ``devices`` (module docstring), skew set to the worst case.

    ``base`` supplies the model, device memory, α, dtype, s, byte counts and global batch.
    """
    for shape in _shapes(base, devices):
        for b in MICRO_BATCHES:
            if base.global_batch is not None and base.global_batch % (shape.dp * b):
                continue
            for recompute in RECOMPUTE_MODES:
                for bins in BINS if recompute != "none" else BINS[:1]:
                    cfg = replace(shape, micro_batch=b, recompute=recompute, bins=bins)
                    yield replace(cfg, skews=(cfg.worst_skew,))


def valid_device_counts(base: PlanConfig) -> tuple[int, ...] | None:
    """Every N with at least one layout of :func:`layouts`, ascending; None when every N has one.

    N = t·cp·p·dp with t, cp from the model and s, p <= L and dp dividing the global batch
    (b = 1 and e = 1 always complete such a shape). Without a global batch dp is free, so
    every N >= 1 has a layout (t = cp = p = 1, dp = N).
    """
    if base.global_batch is None:
        return None
    counts = {t * cp * p * dp for t, cp in _sizes(base)
              for p in range(1, base.model.num_layers + 1) for dp in _divisors(base.global_batch)}
    return tuple(sorted(counts))


def nearest_valid_devices(base: PlanConfig, devices: int) -> tuple[int | None, int | None]:
    """The nearest device counts below and above ``devices`` that have a valid layout.

    Returns:
        (the largest N' < N, the smallest N' > N) with at least one layout of :func:`layouts`;
        None where there is none: N = 1 has no smaller count, and no count above the largest
        valid one (t_max·cp_max·L·global batch at most) has a layout.
    """
    counts = valid_device_counts(base)
    if counts is None:
        return (devices - 1 if devices > 1 else None), devices + 1
    i = bisect.bisect_left(counts, devices)
    j = bisect.bisect_right(counts, devices)
    return (counts[i - 1] if i else None), (counts[j] if j < len(counts) else None)


def parallel_kinds(cfg: PlanConfig) -> int:
    """How many of t, p, e, dp, cp are above 1 (the kinds of parallelism a layout uses)."""
    return sum(size > 1 for size in (cfg.t, cfg.p, cfg.e, cfg.dp, cfg.cp))


def _rank_key(c: Candidate) -> tuple[float, int, int, int, int, int]:
    """:data:`RANK_RULE`, then smaller t, cp and fewer bins (a total order)."""
    cfg = c.plan.config
    return (round(c.cost.relative_time, 3), parallel_kinds(cfg), c.plan.peak_bytes, cfg.t,
            cfg.cp, len(cfg.bins))


def _same_plan(c: Candidate) -> tuple[object, ...]:
    """A layout without its bins, and the c each stage runs at each skew."""
    cfg = c.plan.config
    chunks = tuple(sk.num_chunks for st in c.plan.stages for sk in st.skews)
    return (cfg.t, cfg.p, cfg.e, cfg.dp, cfg.cp, cfg.micro_batch, cfg.recompute, chunks,
            c.plan.peak_bytes)


def _merged(fitting: list[Candidate]) -> list[Candidate]:
    """``fitting`` without the layouts whose extra bins no stage uses (fewer bins kept)."""
    kept: dict[tuple[object, ...], Candidate] = {}
    for c in sorted(fitting, key=lambda c: len(c.plan.config.bins)):
        kept.setdefault(_same_plan(c), c)
    return sorted(kept.values(), key=_rank_key)


def smallest_devices(base: PlanConfig, devices: int) -> int | None:
    """The least N·2^j (j ≥ 1, up to N·4096) with a layout that fits (``full``, b = 1, bins to 16).

    ``full`` recompute, one sequence per micro-batch and the most chunks hold the least
    activation of each (t, p, e, dp, cp), so when none of those fits, nothing does.
    """
    frugal = replace(base, micro_batch=1, recompute="full", bins=BINS[-1], global_batch=None)
    n = devices * 2
    while n <= devices * MAX_DEVICES_FACTOR:
        for shape in _shapes(frugal, n):
            if plan_layout(replace(shape, skews=(shape.worst_skew,))).fits:
                return n
        n *= 2
    return None


def no_layout_message(cfg: PlanConfig, devices: int) -> str:
    """Why no layout exists on ``devices`` and which device counts have one (flag names)."""
    m = cfg.model
    below, above = nearest_valid_devices(cfg, devices)
    near = " or ".join(str(n) for n in (below, above) if n is not None)
    if above is None and below is not None:
        near += ", the most devices that have a layout"
    batch = (f", and dp·b dividing the global batch {cfg.global_batch} (--global-batch)"
             if cfg.global_batch is not None else "")
    return (f"no valid layout on {devices} devices: a layout needs N = t·p·dp·cp with t in "
            f"{{1, 2, 4, 8}} dividing the {m.num_heads} heads, cp in {{1, 2}}, "
            f"t·(2·cp if cp > 1 else 1) dividing s = {cfg.seq_len}, p <= L = {m.num_layers}"
            f"{batch}; try --devices {near}")


def check_devices(devices: object) -> None:
    """Refuse a device count N that is not an int >= 1.

    Raises:
        ValueError: naming ``--devices`` and the value.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"--devices must be an int >= 1, got {devices!r}")


def search(base: PlanConfig, devices: int) -> SearchResult:
    """Plan every valid layout on ``devices`` and rank the ones that fit at the worst skew.

    Args:
        base: the model, device memory, α, dtype, s, byte counts and global batch (its layout
            fields are replaced).
        devices: N ≥ 1.

    Returns:
        The :class:`SearchResult`.

    Raises:
        ValueError: if devices < 1.
    """
    check_devices(devices)
    fitting, least, considered = [], None, 0
    for cfg in layouts(base, devices):
        plan = plan_layout(cfg)
        considered += 1
        if plan.fits:
            fitting.append(Candidate(plan=plan, cost=layout_cost(cfg)))
        elif not fitting:
            need = plan.min_device_memory_bytes
            least = need if least is None else min(least, need)
    ranked = _merged(fitting)
    return SearchResult(
        fitting=tuple(ranked), considered=considered, merged=len(fitting) - len(ranked),
        smallest_device_memory_bytes=None if fitting else least,
        smallest_devices=None if fitting else smallest_devices(base, devices))
