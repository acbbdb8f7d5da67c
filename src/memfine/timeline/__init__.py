"""The allocation timelines that :mod:`memfine.memory.layer` replays, one per code path.

- :mod:`memfine.timeline.experts`: the routed experts (index build, plain and fused
  forward, the streamed fused backward, chunked recomputation).
- :mod:`memfine.timeline.layer`: one whole MoE layer (router, experts, combine).
- :mod:`memfine.timeline.shared`: the shared (always-on) experts.
- :mod:`memfine.timeline.scores`: the router's score functions and renormalisation, one
  entry per score function; :mod:`memfine.timeline.capacity`: capacity routing.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
