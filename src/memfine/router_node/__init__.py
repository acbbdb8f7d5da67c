"""The router and its aux losses as one autograd node that recomputes the logits in backward.

docs/design.md §2 (router node), §5 (its memory model).
"""

from memfine.router_node.node import (
    AuxLosses,
    LossCounts,
    RouterNode,
    aux_losses,
    loss_counts,
    node_applies,
    route_with_losses,
    selected_counts,
)

__all__ = ["AuxLosses", "LossCounts", "RouterNode", "aux_losses", "loss_counts", "node_applies",
           "route_with_losses", "selected_counts"]
