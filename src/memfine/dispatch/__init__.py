"""Buffer-free dispatch: the four MoEBlaze index arrays and their builders (docs/design.md §3)."""

from memfine.dispatch.index import (
    CPU_SORT_FREE_MAX_CELLS,
    SORT_FREE_MAX_CELLS,
    RoutingIndex,
    build_index_argsort,
    build_index_sort_free,
    build_routing_index,
    sort_free_max_cells,
)

__all__ = ["CPU_SORT_FREE_MAX_CELLS", "SORT_FREE_MAX_CELLS", "RoutingIndex", "build_index_argsort",
           "build_index_sort_free", "build_routing_index", "sort_free_max_cells"]
