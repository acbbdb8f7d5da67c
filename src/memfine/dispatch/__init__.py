"""Buffer-free dispatch: the four MoEBlaze index arrays and their builders (docs/design.md §3)."""

from memfine.dispatch.index import (
    RoutingIndex,
    build_index_argsort,
    build_index_sort_free,
    build_routing_index,
)

__all__ = ["RoutingIndex", "build_index_argsort", "build_index_sort_free", "build_routing_index"]
