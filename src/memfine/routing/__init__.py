"""Top-k routing: router, routing result, capacity, group limit, balancing and losses.

docs/design.md §2; DeepSeek-V3 §2.1.2 (groups, scaling, aux-loss-free bias, sequence loss); GShard
§2.2 / Switch Transformer §2.2 (capacity).
"""

from memfine.routing.balance import update_selection_bias
from memfine.routing.capacity import capacity_keep_mask, expert_capacity, max_routed_rows
from memfine.routing.groups import group_limited_scores, top_k_lowest_index
from memfine.routing.losses import (
    check_token_mask,
    load_balancing_loss,
    sequence_balance_loss,
    z_loss,
)
from memfine.routing.router import RouteOptions, RoutingResult, TopKRouter, route

__all__ = ["RouteOptions", "RoutingResult", "TopKRouter", "capacity_keep_mask",
           "check_token_mask", "expert_capacity", "group_limited_scores", "load_balancing_loss",
           "max_routed_rows", "route", "sequence_balance_loss", "top_k_lowest_index",
           "update_selection_bias", "z_loss"]
