"""Top-k routing: router module, routing result, load-balancing and z losses (docs/design.md §2)."""

from memfine.routing.losses import load_balancing_loss, z_loss
from memfine.routing.router import RoutingResult, TopKRouter, route

__all__ = ["RoutingResult", "TopKRouter", "load_balancing_loss", "route", "z_loss"]
