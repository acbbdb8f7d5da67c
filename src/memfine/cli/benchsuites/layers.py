"""Benchmark methods built on one MoE layer: memfine's paths and the baselines users run today.

Every method of a point shares one set of weights (the same ``nn.Parameter`` objects), the same
input x (T, d) and the same incoming gradients, and follows the memory model's protocol: x exists
before the call and requires grad; the parameters have no ``.grad`` (set to ``None`` before each
call); backward runs from the output, the load-balancing loss and the z-loss with gradients that
exist before (:func:`memfine.schedule.memory_model.moe_layer_memory`).

Baselines written here (not part of memfine's API):

- :class:`ExpertLoopMoELayer`: the per-expert Python loop with index masks of transformers'
  ``eager`` experts (gather, two matmuls, weighted ``index_add_``);
- :class:`CheckpointedLayer`: ``torch.utils.checkpoint`` (non-reentrant) around the whole layer,
  router included, as full activation checkpointing of a layer does.

Legend: T tokens, R rows of one expert, K top-k slots, E experts, D = d, N = n.
Reference: DESIGN.md §5 (memory per scheme), §7 (what users compare with).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfine.cli.benchsuites.options import LayerShape
from memfine.config import ChunkConfig, MoEConfig
from memfine.measure.harness import Extra, Method
from memfine.nn import MoELayer
from memfine.ops.activations import apply_activation
from memfine.schedule import memory_model
from memfine.schedule.policy import ChunkPolicy


class ExpertLoopMoELayer(MoELayer):
    """MoE layer whose experts run as a Python loop over experts (transformers ``eager`` style)."""

    def run_experts(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Per expert: rows by mask → up-projection → activation → down-projection → index_add_.

        Memory: autograd saves, per expert, the gathered rows, H, the activation's tensors, the
        output rows and the weights (as the plain path, plus the per-expert index tensors).
        """
        w_up_EDG, w_down_END = self.experts.w_up, self.experts.w_down
        weights_TK = top_k_weights.to(x_TD.dtype)
        out_TD = torch.zeros_like(x_TD)
        for e in range(self.config.num_experts):
            token_R, slot_R = torch.where(top_k_index == e)
            if token_R.numel() == 0:
                continue
            a_RN = apply_activation(x_TD[token_R] @ w_up_EDG[e], self.config.activation)
            y_RD = (a_RN @ w_down_END[e]) * weights_TK[token_R, slot_R, None]
            out_TD.index_add_(0, token_R, y_RD)
        return out_TD, 1


class CheckpointedLayer(nn.Module):
    """Non-reentrant checkpoint around a whole MoE layer (backward re-runs it, router included).

    Memory: keeps only the layer input for backward; the recompute in backward rebuilds
    everything the wrapped layer saves, so the backward peak is the wrapped layer's.
    """

    def __init__(self, layer: MoELayer) -> None:
        """Wrap ``layer`` (its parameters stay its own)."""
        super().__init__()
        self.layer = layer
        self.config = layer.config

    def forward(self, x: torch.Tensor) -> Any:
        """Same as the wrapped layer: ``(out, aux)``."""
        return checkpoint(self.layer, x, use_reentrant=False, preserve_rng_state=False)


def base_layer(moe: MoEConfig, *, dtype: torch.dtype, device: torch.device, seed: int
               ) -> MoELayer:
    """The layer whose weights every method of a point shares (seeded init, then cast)."""
    torch.manual_seed(seed)
    return MoELayer(moe).to(device=device, dtype=dtype)


def sharing(base: MoELayer, moe: MoEConfig, *, chunk: ChunkConfig | None = None,
            cls: type[MoELayer] = MoELayer) -> MoELayer:
    """A new layer of class ``cls`` that uses ``base``'s parameter objects and buffers.

    Raises:
        ValueError: if ``moe`` changes a size of ``base``'s config.
    """
    sizes = ("hidden_size", "intermediate_size", "num_experts", "top_k", "activation")
    if any(getattr(moe, f) != getattr(base.config, f) for f in sizes):
        raise ValueError(f"a sharing layer must keep the sizes of the base layer, got {moe}")
    layer = cls(moe, chunk=chunk)
    layer.router.weight = base.router.weight
    layer.router.selection_bias = base.router.selection_bias
    layer.experts.w_up = base.experts.w_up
    layer.experts.w_down = base.experts.w_down
    return layer


def layer_inputs(shape: LayerShape, *, dtype: torch.dtype, device: torch.device, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input x (T, d) requiring grad and the incoming gradient (T, d), both N(0, 1), seeded."""
    gen = torch.Generator().manual_seed(seed + 1)
    x_TD = torch.randn(shape.tokens, shape.hidden_size, generator=gen)
    grad_TD = torch.randn(shape.tokens, shape.hidden_size, generator=gen)
    return (x_TD.to(device=device, dtype=dtype).requires_grad_(True),
            grad_TD.to(device=device, dtype=dtype))


def budget_for_rows(moe: MoEConfig, num_tokens: int, dtype_bytes: int, rows: int) -> int:
    """The MACT budget whose s′_max is ``rows`` received rows at T = ``num_tokens`` (Eq. 8).

    fixed(T) + rows · row bytes, from the memory model (recompute ``experts``).
    """
    policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
    return policy.fixed_bytes(num_tokens, dtype_bytes) + rows * policy.row_bytes(dtype_bytes)


def half_rows_budget(moe: MoEConfig, num_tokens: int, dtype_bytes: int) -> int:
    """The automatic budget of the layer and model suites: half the received rows per chunk.

    With balanced routing MACT then picks c = 2.
    """
    return budget_for_rows(moe, num_tokens, dtype_bytes,
                           max(1, math.ceil(num_tokens * moe.top_k / 2)))


def layer_method(name: str, layer: nn.Module, x_TD: torch.Tensor, grad_TD: torch.Tensor, *,
                 modelled: bool = True, budget_bytes: int | None = None) -> Method:
    """A :class:`Method` running ``layer`` forward + backward under the model's protocol.

    Args:
        name: provider name.
        layer: a :class:`MoELayer` (or a wrapper with the same call signature).
        x_TD: (T, d) input requiring grad.
        grad_TD: (T, d) gradient of the output.
        modelled: predict with :func:`memory_model.moe_layer_memory` (the layer's config,
            recompute mode and the chunk count of its last call).
        budget_bytes: the MACT budget, reported as the extra ``budget_bytes``.
    """
    one = torch.ones((), device=x_TD.device)
    state = {"num_chunks": 1}
    config: MoEConfig = layer.config  # type: ignore[assignment]

    def forward() -> Any:
        out, aux = layer(x_TD)
        state["num_chunks"] = aux.num_chunks
        return out, aux

    def backward(res: Any) -> None:
        out, aux = res
        torch.autograd.backward([out, aux.load_balancing_loss, aux.z_loss], [grad_TD, one, one])

    def zero_grad() -> None:
        x_TD.grad = None
        for p in layer.parameters():
            p.grad = None

    def predict() -> dict[str, int | None]:
        recompute = layer.policy.config.resolved_recompute  # type: ignore[union-attr]
        m = memory_model.moe_layer_memory(config, x_TD.shape[0], x_TD.element_size(),
                                          num_chunks=state["num_chunks"], recompute=recompute)
        return {"saved_bytes": m.saved_bytes, "peak_bytes": m.peak_bytes}

    def extras() -> dict[str, Extra]:
        out: dict[str, Extra] = {"num_chunks": (state["num_chunks"], "chunks")}
        if budget_bytes is not None:
            out["budget_bytes"] = (budget_bytes, "bytes")
        return out

    return Method(name=name, forward=forward, backward=backward, zero_grad=zero_grad,
                  tokens=x_TD.shape[0], exclude=lambda: list(layer.buffers()),
                  predict=predict if modelled else None, extras=extras)


def add_ratios(results: list[Any], *, floor_bytes: int | None = None,
               budget_bytes: dict[str, int] | None = None) -> None:
    """Add ``saved_over_floor`` and ``peak_over_budget`` (ratios) to measured results in place."""
    for res in results:
        if floor_bytes and res.saved_bytes is not None:
            res.extras["saved_over_floor"] = (res.saved_bytes / floor_bytes, "ratio")
        budget = (budget_bytes or {}).get(res.name)
        if budget and res.peak_bytes is not None:
            res.extras["peak_over_budget"] = (res.peak_bytes / budget, "ratio")
