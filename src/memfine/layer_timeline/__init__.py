"""The allocation timeline of one whole MoE layer, which :mod:`memfine.memory.layer` replays.

- :mod:`memfine.layer_timeline.layer`: the router node, routed experts and combine, in the order
  forward and the autograd engine run them (:func:`~memfine.layer_timeline.layer.simulate_layer`).
- :mod:`memfine.layer_timeline.router`: the router node (router and aux losses without a graph in
  forward, recomputed and differentiated in its backward).
- :mod:`memfine.layer_timeline.shared`: the shared (always-on) experts.
- :mod:`memfine.layer_timeline.ep`: a layer whose routed experts run expert-parallel (the dispatch
  plan, the all-to-alls' rows around the fused experts on the received rows).

The expert path and the router's pieces are in :mod:`memfine.timeline`.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
