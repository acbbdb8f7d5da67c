"""LoRA adapters on memfine's own routed experts: the module, and adapting a trained model.

:class:`LoRAGroupedExperts` is :class:`memfine.nn.experts.GroupedExperts` with frozen base weights
and per-expert adapters (``lora_a_up`` (E, r, d), ``lora_b_up`` (E, G, r), ``lora_a_down``
(E, r, n), ``lora_b_down`` (E, d, r)), run by the split LoRA of the fused path
(:func:`memfine.experts.lora_experts.run_lora_experts`) in the same c token chunks, under the
same recompute modes. :func:`apply_lora` turns every :class:`memfine.nn.MoELayer` of a model into
one with adapters and freezes what the :class:`LoRAConfig` does not train;
:func:`adapter_state_dict` / :func:`merge_lora_` (:func:`merge_model_lora_` for a whole model) save
the adapters and fold them into the base.

Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n (gated) or n, R = r.
Reference: Hu et al. 2021 (LoRA: A ~ Kaiming-uniform, B = 0, so training starts at the base
model); MemFine §4 (chunks).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memfine.config import MoEConfig, Recompute
from memfine.config.lora import LoRAConfig, check_lora_rank
from memfine.dispatch import build_routing_index
from memfine.experts.lora_experts import run_lora_experts
from memfine.lora.adapters import ExpertLoRA
from memfine.lora.quant import NF4Experts, QuantizedBase
from memfine.nn.experts import GroupedExperts
from memfine.schedule.chunked import run_chunked

ADAPTER_PREFIX = "lora_"


class LoRAGroupedExperts(GroupedExperts):
    """Routed experts with frozen ``w_up``/``w_down`` and trainable per-expert adapters.

    Args:
        config: the layer's :class:`MoEConfig` (``experts_impl`` must be ``fused``).
        lora: the :class:`LoRAConfig` (rank, α, dropout, targets).
        init_std, depth: as :class:`GroupedExperts`.

    With ``lora.base_quant="nf4"`` (QLoRA) the frozen ``w_up`` / ``w_down`` parameters are
    replaced by their NF4 codes and absmax (:meth:`quantize_base_`, non-persistent buffers:
    the base is read from its own checkpoint and quantised again, deterministically); each
    row block of the fused path dequantises the experts it holds.

    Raises:
        ValueError: when the rank exceeds min(d_in, d_out) of an adapted weight, the
            experts path is not ``fused``, or a 4-bit base's d·G or n·d is not a multiple
            of ``lora.base_quant_block_size``.

    Attributes:
        transport_row_elements: 0: the rank-r intermediates U that each routed row keeps are
            in the LoRA layer's timeline (:class:`memfine.schedule.lora_policy.
            LoRAChunkPolicy`), not added per row.
    """

    def __init__(self, config: MoEConfig, lora: LoRAConfig, *, init_std: float = 0.02,
                 depth: int = 1, quantize: bool = True) -> None:
        """Build base weights (frozen) and adapters; arguments as on the class.

        ``quantize=False`` keeps a 4-bit config's base in full precision until
        :meth:`quantize_base_` (to copy trained weights in first).
        """
        if config.experts_impl != "fused":
            raise ValueError(f"LoRA on the experts needs MoEConfig.experts_impl='fused', got "
                             f"{config.experts_impl!r}")
        super().__init__(config, init_std=init_std, depth=depth)
        self.lora = lora
        E, D, N, G, r = (config.num_experts, config.hidden_size, config.intermediate_size,
                         config.up_width, lora.rank)
        shapes: dict[str, tuple[int, int, int]] = {}
        if "w_up" in lora.targets:
            check_lora_rank(r, D, G)
            shapes.update(lora_a_up=(E, r, D), lora_b_up=(E, G, r))
        if "w_down" in lora.targets:
            check_lora_rank(r, N, D)
            shapes.update(lora_a_down=(E, r, N), lora_b_down=(E, D, r))
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.w_up.requires_grad_(False)
        self.w_down.requires_grad_(False)
        self.reset_adapters()
        self.quantized = False  # the base is NF4 buffers (quantize_base_)
        if lora.base_quant is not None and quantize:
            self.quantize_base_()

    @torch.no_grad()
    def quantize_base_(self) -> None:
        """Replace the frozen ``w_up`` / ``w_down`` by NF4 codes and absmax (deterministic).

        The buffers ``w_up_nf4_codes`` / ``w_up_nf4_absmax`` (and ``w_down_``'s) and the 16 NF4
        levels ``nf4_code`` are non-persistent; the fp32 absmax and levels are held as their
        int32 bits, so ``module.to(dtype)`` leaves them exact. The base dequantises to the
        adapters' dtype. Memory: (E·d·G + E·n·d) / 2 + 4·(E·d·G + E·n·d) / block_size + 64
        bytes resident instead of (E·d·G + E·n·d)·D_t.

        Raises:
            ValueError: when d·G or n·d is not a multiple of the block size (nothing changed).
        """
        quant = QuantizedBase.quantize(self.w_up, self.w_down, self.lora.base_quant_block_size)
        del self.w_up, self.w_down
        for name, nf4 in (("w_up", quant.up), ("w_down", quant.down)):
            self.register_buffer(f"{name}_nf4_codes", nf4.codes, persistent=False)
            self.register_buffer(f"{name}_nf4_absmax", nf4.absmax.float().view(torch.int32),
                                 persistent=False)
        self.register_buffer("nf4_code", quant.up.code.float().view(torch.int32),
                             persistent=False)
        self.quantized = True

    @torch.no_grad()
    def load_base_(self, w_up_EDG: torch.Tensor, w_down_END: torch.Tensor) -> None:
        """Quantise a base's weights into this module's 4-bit buffers.

        The codes equal :meth:`quantize_base_`'s on the same weights (deterministic).
        """
        device = self.get_buffer("nf4_code").device
        quant = QuantizedBase.quantize(w_up_EDG.to(device), w_down_END.to(device),
                                       self.lora.base_quant_block_size)
        for name, nf4 in (("w_up", quant.up), ("w_down", quant.down)):
            self.get_buffer(f"{name}_nf4_codes").copy_(nf4.codes)
            self.get_buffer(f"{name}_nf4_absmax").copy_(nf4.absmax.float().view(torch.int32))

    def quantized_base(self) -> QuantizedBase | None:
        """The 4-bit base over the current buffers (after any ``.to()``), or None."""
        if not self.quantized:
            return None
        moe, size = self.config, self.lora.base_quant_block_size
        E, D, N, G = (moe.num_experts, moe.hidden_size, moe.intermediate_size, moe.up_width)
        dtype = next(p for n, p in self.named_parameters() if n.startswith("lora_")).dtype
        code = self.get_buffer("nf4_code").view(torch.float32)

        def weight(name: str, shape: tuple[int, int, int]) -> NF4Experts:
            return NF4Experts(self.get_buffer(f"{name}_nf4_codes"),
                              self.get_buffer(f"{name}_nf4_absmax").view(torch.float32),
                              code, torch.Size(shape), dtype, size)
        return QuantizedBase(weight("w_up", (E, D, G)), weight("w_down", (E, N, D)))

    def reset_adapters(self) -> None:
        """A ~ U(±1/√d_in) (Kaiming-uniform with a = √5, as PEFT), B = 0 (the base output)."""
        for name, param in self.named_parameters(recurse=False):
            if name.startswith("lora_a_"):
                bound = 1.0 / math.sqrt(param.shape[2])
                nn.init.uniform_(param, -bound, bound)
            elif name.startswith("lora_b_"):
                nn.init.zeros_(param)

    def adapters(self) -> ExpertLoRA:
        """The adapter parameters as :class:`ExpertLoRA` (s = α / r)."""
        return ExpertLoRA(a_up_ERD=getattr(self, "lora_a_up", None),
                          b_up_EGR=getattr(self, "lora_b_up", None),
                          a_down_ERN=getattr(self, "lora_a_down", None),
                          b_down_EDR=getattr(self, "lora_b_down", None),
                          scale=self.lora.scale,
                          dropout=self.lora.dropout if self.training else 0.0)

    def forward(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, num_chunks: int = 1,
                recompute: Recompute = "none", block_rows: int | None = None) -> torch.Tensor:
        """Run the experts with adapters on routed tokens in c chunks (as the base class).

        :meth:`GroupedExperts.run` calls it with the policy's plan. The dropout seed is drawn
        here, once per call and outside every recomputed region, so a chunk's recompute draws
        the same masks.

        Memory: per chunk, what the fused path saves plus U (S_c·r) per adapter; with recompute
        ``experts``/``full`` only x and the routing survive forward.
        """
        lora = self.adapters()
        seed = int(torch.randint(0, 2**62, ())) if lora.dropout > 0 else 0
        moe = self.config
        block = self.call_block(x_TD, block_rows)
        quant = self.quantized_base()
        w_up, w_down = (self.w_up, self.w_down) if quant is None else quant.stand_ins()

        def chunk_fn(chunk: int, x_CD: torch.Tensor, top_k_index_CK: torch.Tensor,
                     top_k_weights_CK: torch.Tensor) -> torch.Tensor:
            index = build_routing_index(top_k_index_CK, moe.num_experts, moe.index_builder)
            return run_lora_experts(x_CD, top_k_weights_CK, index, w_up, w_down, lora,
                                    activation=moe.activation, backend=moe.gemm_backend,
                                    seed=seed + chunk,
                                    block_rows=block, quant=quant)

        return run_chunked(chunk_fn, x_TD, top_k_index, top_k_weights, num_chunks=num_chunks,
                           recompute=recompute if torch.is_grad_enabled() else "none")


def lora_experts_from(experts: GroupedExperts, lora: LoRAConfig) -> LoRAGroupedExperts:
    """A :class:`LoRAGroupedExperts` with ``experts``' weights (frozen), fresh adapters.

    With ``lora.base_quant`` the copied weights are quantised in ``experts``' dtype and device.
    """
    new = LoRAGroupedExperts(experts.config, lora, init_std=experts.init_std,
                             depth=experts.depth, quantize=False)
    with torch.no_grad():
        new.w_up.copy_(experts.w_up)
        new.w_down.copy_(experts.w_down)
    new = new.to(device=experts.w_up.device, dtype=experts.w_up.dtype)
    if lora.base_quant is not None:
        new.quantize_base_()
    return new


def apply_lora(model: nn.Module, lora: LoRAConfig) -> int:
    """Give every MoE layer of ``model`` expert adapters and freeze the rest as ``lora`` says.

    Every parameter is frozen except the adapters, the routers when ``lora.train_router``, and
    everything outside the routed experts and routers (attention, norms, embeddings, shared
    experts and their gate) when ``lora.train_attention``; the routed experts' base weights
    stay frozen.

    Returns:
        The number of MoE layers adapted.

    Raises:
        ValueError: when the model has no MoE layer with local experts, or a rank is too large.
    """
    from memfine.nn.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers or not all(type(m.experts) is GroupedExperts for m in layers):
        raise ValueError("apply_lora needs a model whose MoE layers hold local GroupedExperts")
    for layer in layers:
        layer.experts = lora_experts_from(layer.experts, lora)
    router_ids = {id(p) for m in layers for p in m.router.parameters()}
    routed_ids = {id(p) for m in layers for p in m.experts.parameters()}
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1].startswith(ADAPTER_PREFIX):
            param.requires_grad_(True)
        elif id(param) in router_ids:
            param.requires_grad_(lora.train_router)
        else:  # the routed experts' base weights stay frozen; shared experts as attention
            param.requires_grad_(lora.train_attention and id(param) not in routed_ids)
    return len(layers)


def load_quantized_bases_(model: nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """Quantise the base weights in ``state`` into ``model``'s 4-bit LoRA experts.

    For every :class:`LoRAGroupedExperts` of ``model`` holding a 4-bit base, its
    ``<prefix>w_up`` / ``<prefix>w_down`` in ``state`` (a plain model's state dict) are
    quantised into its buffers (:meth:`LoRAGroupedExperts.load_base_`). Returns the keys used,
    which the caller leaves out of ``load_state_dict``.
    """
    used: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, LoRAGroupedExperts) and module.quantized:
            keys = (f"{prefix}.w_up", f"{prefix}.w_down")
            if all(k in state for k in keys):
                module.load_base_(state[keys[0]], state[keys[1]])
                used.update(keys)
    return used


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of an adapted model (adapters, and router/attention if trained)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def merge_lora_(experts: LoRAGroupedExperts) -> GroupedExperts:
    """Fold the adapters into the base weights: W + s·(B·A)ᵀ per expert; a plain module back.

    The merged ``w_up`` / ``w_down`` keep the base weights' ``requires_grad`` (False: frozen, as
    under the adapters), so merging changes no parameter's trainability; call
    ``requires_grad_(True)`` on the result to train the merged weights.

    Raises:
        TypeError: when ``experts`` is not a :class:`LoRAGroupedExperts` (a whole model or layer
            is merged with :func:`merge_model_lora_`).
    """
    if not isinstance(experts, LoRAGroupedExperts):
        raise TypeError(f"merge_lora_ takes a LoRAGroupedExperts module, got "
                        f"{type(experts).__name__}; merge a whole model or layer with "
                        f"merge_model_lora_")
    if experts.quantized:
        raise ValueError(f"LoRAConfig.base_quant={experts.lora.base_quant!r} cannot be merged: "
                         f"the adapters were trained on the 4-bit base, whose full-precision "
                         f"weights are gone; merge onto the base run's weights with "
                         f"base_quant=None, or export the adapters alone")
    out = GroupedExperts(experts.config, init_std=experts.init_std, depth=experts.depth)
    out = out.to(device=experts.w_up.device, dtype=experts.w_up.dtype)
    s = experts.lora.scale
    up, down = experts.w_up.clone(), experts.w_down.clone()
    if hasattr(experts, "lora_a_up"):
        up += s * torch.einsum("erd,egr->edg", experts.lora_a_up, experts.lora_b_up)
    if hasattr(experts, "lora_a_down"):
        down += s * torch.einsum("ern,edr->end", experts.lora_a_down, experts.lora_b_down)
    out.w_up.copy_(up)
    out.w_down.copy_(down)
    out.w_up.requires_grad_(experts.w_up.requires_grad)
    out.w_down.requires_grad_(experts.w_down.requires_grad)
    return out


def merge_model_lora_(model: nn.Module) -> int:
    """Fold every MoE layer's adapters into its base weights, in place (:func:`merge_lora_`).

    The layers get plain :class:`GroupedExperts` back, so the model's ``state_dict`` is that of
    a model without adapters; their weights stay frozen as under the adapters (every other
    parameter's ``requires_grad`` is left as it is). Returns the number of layers merged.
    """
    from memfine.nn.moe import MoELayer

    merged = 0
    for layer in model.modules():
        if isinstance(layer, MoELayer) and isinstance(layer.experts, LoRAGroupedExperts):
            layer.experts = merge_lora_(layer.experts)
            merged += 1
    return merged
