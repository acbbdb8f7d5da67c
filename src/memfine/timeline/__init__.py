"""The allocation timelines of the expert path and the router, one per code path.

- :mod:`memfine.timeline.base`: the events (:class:`~memfine.timeline.base.Timeline`) and shapes.
- :mod:`memfine.timeline.experts`: the routed experts (index build, plain and fused
  forward, the streamed fused backward, chunked recomputation).
- :mod:`memfine.timeline.scores`: the router's score functions and renormalisation, one
  entry per score function; :mod:`memfine.timeline.capacity`: capacity routing.

One whole MoE layer (router, experts, shared experts, combine) is in :mod:`memfine.layer_timeline`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
