"""A lower bound of the bytes an MoE model needs, from integer arithmetic alone.

The commands check it before anything is built (``memfine train``'s free-memory check,
``memfine bench``'s given sizes): sizes far beyond the machine are refused before the model
exists, even on the meta device, and before the exact memory model
(:mod:`memfine.memory.layer`) replays a step of that size, which would itself take long or run
out of memory. Python ints are unbounded, so the bound never overflows.
"""

from __future__ import annotations


def weights_and_inputs_lower_bound(*, num_layers: int, num_experts: int, hidden_size: int,
                                   intermediate_size: int, tokens: int, dtype_bytes: int,
                                   gated: bool = True, shards: int = 1) -> int:
    """Bytes the routed experts' weights and the MoE layers' inputs take at least.

    Per MoE layer: the routed experts' weights, ``w_up`` (E·d·G, G = 2n for a gated activation
    such as SwiGLU, else n) and ``w_down`` (E·n·d), split over ``shards`` ranks (rounded up);
    and the layer's input X (T·d), which every recompute mode keeps for backward (MoEBlaze
    §4.2). Everything else a run holds (gradients, optimizer state, attention, the other
    activations) only adds to it.

    Args:
        num_layers: L, MoE layers.
        num_experts: E, routed experts per layer.
        hidden_size: d.
        intermediate_size: n, per GLU branch.
        tokens: T, tokens entering each MoE layer on this process.
        dtype_bytes: D_t, bytes per element of the weights and activations.
        gated: the activation is gated (``MoEConfig.gated``): ``w_up`` holds 2n columns.
        shards: ranks the experts' weights are split over (expert parallelism, FSDP).

    Returns:
        ``(⌈L·E·d·(G + n) / shards⌉ + L·T·d) · D_t`` bytes.
    """
    up_width = 2 * intermediate_size if gated else intermediate_size
    experts = num_layers * num_experts * hidden_size * (up_width + intermediate_size)
    inputs = num_layers * tokens * hidden_size
    return (-(-experts // shards) + inputs) * dtype_bytes
