"""Routing options beyond plain top-k (:class:`RouteOptions`), declared once.

:class:`memfine.config.MoEConfig` inherits these fields, so a layer's config is itself the
``options`` argument of :func:`memfine.routing.route`.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfine._checks import check_choice, check_float, check_int
from memfine.config.base import ConfigBase, DropPolicy

SORT_TOP_K_ON_CPU = False
"""True: the CPU ranks the router's top-k by the stable sort, as a GPU does
(:func:`memfine.routing.top_k_lowest_index`; :func:`memfine.experts.device_path.device_path`
sets it while the counts suite counts a GPU's path)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteOptions(ConfigBase):
    """Group limit, weight scaling and expert capacity of the router (all off by default).

    Attributes:
        capacity_factor: ``None`` (default) routes without dropping; else each expert keeps at
            most ``capacity = min(T, max(min_capacity, ceil(capacity_factor·T·k/E)))`` of the
            (token, slot) pairs that chose it (GShard §2.2, Switch Transformer §2.2), > 0.
            T counts padding tokens too (the input's shape, read without a device sync), so
            padding raises the capacity of every expert.
        min_capacity: lower bound of the capacity in tokens, >= 0 (DeepSpeed-MoE's
            ``min_capacity``); only used with ``capacity_factor``.
        drop_policy: which pairs an over-full expert keeps: ``probs`` (the highest routing
            weights) or ``position`` (the earliest tokens). Ties go to the lower token index.
        n_group: expert groups for group-limited routing (DeepSeek-V3 §2.1.2 node-limited
            routing; HF ``n_group``), >= 1; 1 disables it. In a :class:`MoEConfig` it must
            divide E with >= 2 experts per group.
        topk_group: groups each token may use, in [1, n_group]; a group's score is the sum of
            its two highest (biased) scores; in a :class:`MoEConfig`,
            ``topk_group·E/n_group >= k``.
        routed_scaling_factor: multiplies the k routing weights after renormalisation
            (DeepSeek-V3: 2.5), > 0.

    Raises:
        ValueError: on construction, naming the class and field, what is allowed and the value
            received.
    """

    capacity_factor: float | None = None
    min_capacity: int = 0
    drop_policy: DropPolicy = "probs"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        """Validate the six fields (rules that involve E or k are :class:`MoEConfig`'s)."""
        if self.capacity_factor is not None:
            check_float(self, "capacity_factor", 0.0, lo_open=True)
        check_int(self, "min_capacity", 0)
        check_choice(self, "drop_policy", DropPolicy)
        check_int(self, "n_group", 1)
        check_int(self, "topk_group", 1, self.n_group)
        check_float(self, "routed_scaling_factor", 0.0, lo_open=True)

    @property
    def dropless(self) -> bool:
        """True when no capacity is set (every selected pair is dispatched)."""
        return self.capacity_factor is None
