"""A memory budget for the whole training step: the per-layer plan that meets it at least cost.

:class:`StepPlanner` chooses, for every MoE block of :class:`memfine.nn.MoETransformerLM`, one of
no recompute, chunked expert recompute or full block recompute, each with a chunk count c from
the bins, so that the step's predicted activation peak (:func:`memfine.memory.step_timeline.
simulate_step`: embeddings, attention, norms, logits and loss included, across the layers as
backward frees them) fits the budget, minimising the recomputed forward FLOPs (then the total
chunk count: fewer chunk loops, less overhead).

On one process a layer's experts receive s″ ≤ T·k rows whatever the routing, and the step
timeline replays every MoE layer at T·k rows (its exact layer timeline), so one plan per token
count T holds for every routing; it is planned again when T changes (a shorter last batch).

Search: every assignment of the three recompute modes to the layers (3^L, for L ≤ 6; beyond, the
assignments that recompute a prefix of the layers fully and the next ones' experts), each with
the smallest chunk counts that fit (uniform c first, then lowered layer by layer).

Legend: T tokens, L layers, d, n, k as docs/design.md §1.
Reference: MemFine §4 (chunked recompute against full recompute under a memory budget, Eq. 2-3);
docs/design.md §4-§5.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from memfine.config import ModelConfig, RecomputeMode
from memfine.memory.step_timeline import STEP_RECOMPUTE, LayerChoice, simulate_step

EXHAUSTIVE_MAX_LAYERS = 6
"""Up to this many layers every recompute assignment (3^L) is searched."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's per-layer choices and what they cost.

    Attributes:
        choices: one :class:`LayerChoice` per layer, first layer first.
        predicted_peak_bytes: the step timeline's peak, bytes.
        recompute_flops: forward FLOPs run again in backward (0 without recompute).
    """

    choices: tuple[LayerChoice, ...]
    predicted_peak_bytes: int
    recompute_flops: int


def recompute_flops(config: ModelConfig, batch: int, seq: int, recompute: str) -> int:
    """Forward FLOPs one block runs again in backward under ``recompute``.

    ``experts``: the routed (and shared) experts, 2·T·k·d·(G + n) (MemFine Table 2 sizes;
    6·T·k·d·n gated, docs/design.md §5). ``full``: that plus attention, 2·T·d·4d for the
    projections and 2·B·Q²·d for causal scores and values. ``none``: 0.
    """
    if recompute == "none":
        return 0
    moe, T = config.moe, batch * seq
    D = moe.hidden_size
    flops = 2 * T * moe.top_k * D * (moe.up_width + moe.intermediate_size)
    if moe.num_shared_experts:
        sh = moe.shared_experts_config()
        flops += 2 * T * sh.num_experts * D * (sh.up_width + sh.intermediate_size)
    if recompute == "full":
        flops += 2 * T * D * 4 * D + 2 * batch * seq * seq * D
    return flops


class StepPlanner:
    """Plans one training step under a budget on its activation peak (per T, cached).

    Args:
        config: the model (``config.chunk.bins`` are the chunk counts tried).
        batch: B sequences per step (micro-batch).
        seq: Q tokens per sequence.
        dtype_bytes: D_t of activations and parameters.
        device_type: the activations' device (:func:`memfine.memory.step_timeline.simulate_step`).
    """

    def __init__(self, config: ModelConfig, batch: int, seq: int, dtype_bytes: int,
                 device_type: str = "cpu") -> None:
        """Keep the shapes; arguments as on the class."""
        self.config, self.batch, self.seq, self.dtype_bytes = config, batch, seq, dtype_bytes
        self.device_type = device_type
        self.bins = config.chunk.bins
        self._peaks: dict[tuple[LayerChoice, ...], int] = {}

    def peak(self, choices: tuple[LayerChoice, ...]) -> int:
        """Predicted step peak of a plan, bytes (cached)."""
        if choices not in self._peaks:
            self._peaks[choices] = simulate_step(self.config, self.batch, self.seq,
                                                 self.dtype_bytes, choices,
                                                 self.device_type).peak
        return self._peaks[choices]

    def _flops(self, recompute: str) -> int:
        return recompute_flops(self.config, self.batch, self.seq, recompute)

    def _assignments(self) -> list[tuple[RecomputeMode, ...]]:
        L = self.config.num_layers
        if L <= EXHAUSTIVE_MAX_LAYERS:
            return list(itertools.product(STEP_RECOMPUTE, repeat=L))
        full: tuple[RecomputeMode] = ("full",)
        experts: tuple[RecomputeMode] = ("experts",)
        none: tuple[RecomputeMode] = ("none",)
        return [full * a + experts * b + none * (L - a - b)
                for a in range(L + 1) for b in range(L + 1 - a)]

    def _fit(self, modes: tuple[RecomputeMode, ...], budget: int) -> tuple[LayerChoice, ...] | None:
        """The smallest chunk counts that fit with these modes, or None."""
        plan = None
        for c in self.bins:
            uniform = tuple(LayerChoice(m, c) for m in modes)
            if self.peak(uniform) <= budget:
                plan = list(uniform)
                break
        if plan is None:
            return None
        for i in reversed(range(len(plan))):  # lower each layer's c while it still fits
            for c in self.bins:
                if c >= plan[i].num_chunks:
                    break
                trial = plan[:i] + [LayerChoice(plan[i].recompute, c)] + plan[i + 1:]
                if self.peak(tuple(trial)) <= budget:
                    plan = trial
                    break
        return tuple(plan)

    def plan(self, budget_bytes: int) -> StepPlan | None:
        """The least-recompute plan whose predicted step peak fits ``budget_bytes``.

        Returns:
            The :class:`StepPlan`, or None when no plan fits (see
            :meth:`smallest_feasible_budget`).
        """
        best: tuple[tuple[int, int], tuple[LayerChoice, ...]] | None = None
        for modes in sorted(self._assignments(), key=lambda m: sum(map(self._flops, m))):
            flops = sum(map(self._flops, modes))
            if best is not None and flops > best[0][0]:
                break
            choices = self._fit(modes, budget_bytes)
            if choices is None:
                continue
            key = (flops, sum(c.num_chunks for c in choices))
            if best is None or key < best[0]:
                best = (key, choices)
        if best is None:
            return None
        return StepPlan(best[1], self.peak(best[1]), best[0][0])

    def least_memory_plan(self) -> StepPlan:
        """The plan with the lowest predicted peak (every assignment at the largest bin)."""
        c = self.bins[-1]
        plans = [tuple(LayerChoice(m, c) for m in modes) for modes in self._assignments()]
        choices = min(plans, key=lambda p: (self.peak(p), sum(map(self._flops,
                                                              (x.recompute for x in p)))))
        return StepPlan(choices, self.peak(choices),
                        sum(self._flops(x.recompute) for x in choices))

    def smallest_feasible_budget(self) -> int:
        """The least step budget some plan meets, bytes."""
        return self.least_memory_plan().predicted_peak_bytes


@functools.lru_cache(maxsize=32)
def step_planner(config: ModelConfig, batch: int, seq: int, dtype_bytes: int,
                 device_type: str = "cpu") -> StepPlanner:
    """A shared :class:`StepPlanner` per (config, B, Q, D_t, device) (its peaks cached inside)."""
    return StepPlanner(config, batch, seq, dtype_bytes, device_type)
