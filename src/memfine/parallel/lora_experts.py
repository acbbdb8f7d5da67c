"""Expert-parallel routed experts with split LoRA adapters (``memfine train --lora-rank`` on ranks).

Legend: E experts (global), L experts on this rank (E/ep), D = d, N = n, G = 2n (gated) or n,
R = r (the adapters' rank).

:class:`ExpertParallelLoRAExperts` is :class:`memfine.parallel.ExpertParallelExperts` with frozen
base weights and the per-expert adapters of :class:`memfine.nn.lora.LoRAGroupedExperts`, under the
same names and global shapes: ``lora_a_up`` (E, r, d), ``lora_b_up`` (E, G, r), ``lora_a_down``
(E, r, n), ``lora_b_down`` (E, d, r), DTensors ``Shard(0)`` over ``ep`` like ``w_up``/``w_down``.
Every chunk's received rows run through the split LoRA of the fused path
(:func:`memfine.experts.lora_experts.run_lora_experts`) on this rank's L experts. The adapters'
gradient scale (1/ep, as the base weights'), their checkpoints at another layout and the dropout
masks drawn per received row (other masks than one process's when dropout > 0): docs/lora.md,
"On several ranks (torchrun)".
A 4-bit base (QLoRA, ``LoRAConfig.base_quant``) stays 4-bit: the rank keeps its L experts' NF4
codes and absmax (``quant``); ``w_up`` / ``w_down`` are (L, 0, 0) frozen placeholders.
Reference: Hu et al. 2021 (LoRA); MemFine §4; docs/lora.md.
"""

from __future__ import annotations

import torch
from torch import nn

from memfine.config import MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.lora.adapters import ExpertLoRA
from memfine.parallel.experts import ExpertParallelExperts
from memfine.parallel.mesh import ParallelContext

ADAPTERS = ("lora_a_up", "lora_b_up", "lora_a_down", "lora_b_down")


class ExpertParallelLoRAExperts(ExpertParallelExperts):
    """This rank's L = E/ep experts with frozen base weights and trainable split-LoRA adapters.

    Args:
        config: the layer's :class:`MoEConfig` (E global; ``experts_impl`` ``fused``).
        lora: the :class:`LoRAConfig` (rank, α, dropout, targets).
        context: this rank's :class:`ParallelContext`.
        grad_scale: as :class:`ExpertParallelExperts`; applied to the adapters' gradients.

    Attributes:
        lora: as given.

    Raises:
        ValueError: if E is not divisible by ep, or ``experts_impl`` is not ``fused``.
    """

    def __init__(self, config: MoEConfig, lora: LoRAConfig, context: ParallelContext, *,
                 grad_scale: float = 1.0) -> None:
        """Frozen zero base weights, no adapters yet (:meth:`from_lora_experts` adds them)."""
        if config.experts_impl != "fused":
            raise ValueError(f"LoRA on the experts needs MoEConfig.experts_impl='fused', got "
                             f"{config.experts_impl!r}")
        super().__init__(config, context, grad_scale=grad_scale)
        self.lora, self.ep_model = lora, False  # the adapters are not in the EP timeline
        self.w_up.requires_grad_(False)
        self.w_down.requires_grad_(False)

    @classmethod
    def from_lora_experts(cls, full: nn.Module, context: ParallelContext, *,
                          grad_scale: float = 1.0) -> ExpertParallelLoRAExperts:
        """This rank's slice (a copy) of a whole :class:`memfine.nn.lora.LoRAGroupedExperts`.

        No communication: every rank holds the same whole module (same seed and base). Each
        parameter (base weights and adapters, as DTensors ``Shard(0)`` over ``ep``) keeps the
        ``requires_grad`` of the whole module's.
        """
        config, lora = full.config, full.lora
        assert isinstance(config, MoEConfig) and isinstance(lora, LoRAConfig)
        module = cls(config, lora, context, grad_scale=grad_scale)
        local = context.local_experts(config.num_experts)
        for name, param in full.named_parameters(recurse=False):
            mine = module._shard(param.detach()[local.start:local.stop].clone())
            mine.requires_grad_(param.requires_grad)
            module.register_parameter(name, mine)
        quantized = getattr(full, "quantized", False)  # LoRAGroupedExperts.quantize_base_
        quant = full.quantized_base() if quantized else None  # type: ignore[operator]
        if quant is not None:  # a 4-bit base: this rank's experts' codes, no full-precision copy
            module.quant = quant.experts(local.start, local.stop)
            for name in ("w_up", "w_down"):  # (L, 0, 0) frozen placeholders
                module.register_parameter(name, module._shard(torch.zeros(local.stop - local.start,
                                                                          0, 0)))
                getattr(module, name).requires_grad_(False)
        return module

    def adapters(self) -> ExpertLoRA:
        """This rank's (L, ...) adapters as :class:`ExpertLoRA`, gradients scaled by grad_scale."""
        local = {name: self.local(getattr(self, name)) if hasattr(self, name) else None
                 for name in ADAPTERS}
        return ExpertLoRA(a_up_ERD=local["lora_a_up"], b_up_EGR=local["lora_b_up"],
                          a_down_ERN=local["lora_a_down"], b_down_EDR=local["lora_b_down"],
                          scale=self.lora.scale,
                          dropout=self.lora.dropout if self.training else 0.0)

    def _call_adapters(self) -> tuple[ExpertLoRA | None, int]:
        """This call's adapters and dropout seed.

        The seed is drawn once per call, outside recompute, as
        :class:`memfine.nn.lora.LoRAGroupedExperts` does.
        """
        lora = self.adapters()
        return lora, int(torch.randint(0, 2**62, ())) if lora.dropout > 0 else 0
