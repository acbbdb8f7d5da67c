"""Rows per fused row block of one layer call: where a config's bytes meet the layer's dims.

``MoEConfig.backward_block_bytes`` (bytes, or None for the device's default) and a memory
budget's ladder rungs (:func:`memfine.config.budget_block_ladder`) are byte targets; the layer,
its experts, the chunk policy's decisions and the memory model pass rows. These functions are
where the two meet the layer's d, n, G, D_t and device (:func:`backward_block_rows`): the chunk
policy resolves every call's rows with them, a direct call of the experts resolves its config
with them, and the memory model resolves a config it is given without rows.

Reference: MoEBlaze §4.2 (row tiles); MemFine §4.2 (MACT's budget); our sizing.
"""

from __future__ import annotations

from memfine.config.moe import MoEConfig, backward_block_rows, block_row_bytes, budget_block_ladder


def config_block_rows(moe: MoEConfig, dtype_bytes: int, device_type: str = "cpu") -> int:
    """Rows per block of ``moe``'s own ``backward_block_bytes`` (None: the device default).

    Args:
        moe: the layer config (d, n, G and ``backward_block_bytes``).
        dtype_bytes: D_t, bytes per activation element the experts compute in.
        device_type: the activations' device type.

    Returns:
        :func:`backward_block_rows` of the config at D_t on ``device_type`` (≥ 1).
    """
    return backward_block_rows(moe.backward_block_bytes, moe.hidden_size, moe.intermediate_size,
                               moe.up_width, dtype_bytes, device_type)


def ladder_block_rows(moe: MoEConfig, dtype_bytes: int, device_type: str = "cpu"
                      ) -> tuple[int, ...]:
    """The rows per block a budgeted call of ``moe`` may run, largest first.

    :func:`memfine.config.budget_block_ladder` (the config's bytes when set; else the device
    default and half and a quarter of its rows), each rung turned into rows at D_t.

    Returns:
        One int ≥ 1 per rung; the first is :func:`config_block_rows`.
    """
    d, n, G = moe.hidden_size, moe.intermediate_size, moe.up_width
    ladder = budget_block_ladder(moe.backward_block_bytes, device_type,
                                 block_row_bytes(d, n, G, dtype_bytes))
    return tuple(backward_block_rows(b, d, n, G, dtype_bytes, device_type) for b in ladder)


def shared_block_rows(moe: MoEConfig, block_rows: int | None, dtype_bytes: int,
                      device_type: str = "cpu") -> int:
    """Rows per block of the shared experts in a call whose routed experts run ``block_rows``.

    The shared experts (n = n_s) run the call's byte target at their own row bytes: the
    config's own rows (``backward_block_bytes``, None: the device default, at least
    :data:`memfine.config.MIN_BLOCK_ROWS` rows) when the routed experts run the config's own,
    else (a budget's smaller rung) ⌊block_rows · routed row bytes / shared row bytes⌋.

    Args:
        moe: the MoE layer's config (``num_shared_experts`` ≥ 1).
        block_rows: the routed experts' rows per block in this call; None: the config's own.
        dtype_bytes: D_t.
        device_type: the activations' device type.
    """
    shared = moe.shared_experts_config()
    if block_rows is None or block_rows == config_block_rows(moe, dtype_bytes, device_type):
        return config_block_rows(shared, dtype_bytes, device_type)
    target = block_rows * block_row_bytes(moe.hidden_size, moe.intermediate_size, moe.up_width,
                                          dtype_bytes)
    return backward_block_rows(target, shared.hidden_size, shared.intermediate_size,
                               shared.up_width, dtype_bytes, device_type)
