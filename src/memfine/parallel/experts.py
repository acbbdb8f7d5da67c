"""Routed experts sharded over the ``ep`` mesh dim, run with MemFine's token chunks.

Legend: T tokens, K top-k slots, E experts (global), L experts on this rank (E/ep), P ranks of
the ``ep`` dim, M routed rows this rank sends (≤ T·k), S rows this rank's experts receive (s″),
D = d, N = n, G = 2n (gated) or n.

:class:`ExpertParallelExperts` is a peer of :class:`memfine.nn.GroupedExperts`: same parameter
names, same ``run``/``global_counts`` contract, so sharding a model only swaps each layer's
``experts``. One layer call: notify (:func:`exchange_counts`: per-expert counts of each chunk
of every candidate c, one all-to-all of ints); the policy's c, agreed with ONE all-reduce MAX
over ``ep`` per budgeted call (the fused row blocks stay the rank's own); then the one chunk loop
(:func:`memfine.schedule.chunked.run_chunked`) runs :func:`ep_chunk_forward` on each chunk's
frozen plan, which recompute reuses (:meth:`ExpertParallelExperts.run`).

A state dict holds every expert under its single-process name and global shape (DTensors
``Shard(0)`` over ``ep``, perhaps further over ``dp_shard``): DCP checkpoints reshard.
Reference: MemFine §4 (arXiv 2511.21431); MoEBlaze §4-§5; docs/design.md §4.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from memfine.config import MoEConfig
from memfine.experts import compute_element_size, run_experts
from memfine.experts.lora_experts import run_lora_experts
from memfine.lora.adapters import ExpertLoRA
from memfine.lora.quant import QuantizedBase
from memfine.ops.weight_grads import WeightGradBuffers
from memfine.parallel.collectives import agree_num_chunks, all_to_all, collective_device
from memfine.parallel.mesh import ParallelContext, check_expert_sharding
from memfine.parallel.notify import ChunkDispatch, ExpertCounts, exchange_counts, plan_chunks
from memfine.parallel.rows import combine_returned_rows, dispatch_rows
from memfine.schedule.chunked import run_chunked, share_chunk_weight_grads
from memfine.schedule.decision import chunk_rows_of
from memfine.schedule.policy import ChunkPlan, ChunkPolicy


def ep_chunk_forward(x_TD: torch.Tensor, top_k_weights: torch.Tensor, w_up_LDG: torch.Tensor,
                     w_down_LND: torch.Tensor, plan: ChunkDispatch,
                     group: dist.ProcessGroup, config: MoEConfig,
                     weight_grads: WeightGradBuffers | None = None, *, block_rows: int,
                     lora: ExpertLoRA | None = None, seed: int = 0,
                     quant: QuantizedBase | None = None) -> torch.Tensor:
    """Dispatch → local experts → combine for one chunk of tokens.

    Args:
        x_TD: (T_c, d) the chunk's activations.
        top_k_weights: (T_c, k) routing weights.
        w_up_LDG: (L, d, G) this rank's up-projections.
        w_down_LND: (L, n, d) this rank's down-projections.
        plan: the chunk's frozen :class:`ChunkDispatch`.
        group: the ``ep`` process group.
        config: the layer's :class:`MoEConfig` (activation, experts_impl, gemm_backend).
        weight_grads: the chunk loop's shared weight-gradient buffers (fused path, c > 1), or
            ``None``: the fused backward adds this chunk's weight gradients into them.
        block_rows: rows per fused row block (the layer call's :class:`ChunkPlan`).
        lora: this rank's (L, ...) split-LoRA adapters
            (:func:`memfine.experts.lora_experts.run_lora_experts`), or None.
        quant: this rank's 4-bit base (QLoRA; the weights are then its stand-ins), or None.
        seed: the adapters' dropout seed for this chunk (unused without dropout).

    Returns:
        (T_c, d) combined output in x's dtype.

    Side effects: three all-to-alls on the EP group (rows and their routing weights out, weighted
    rows back) and their inverses in backward. Every rank of the group calls this for the same
    chunk, with the same ``requires_grad`` on x and the weights.

    Memory (saved for backward when not recomputed): the received rows S·d·D_t and weights
    S·D_t, the fused path's H (S·G·D_t) and int32 indices; the sent copy (M·d) and the returned
    rows (M·d) are not saved.
    """
    send, recv = plan.send_index, plan.recv_index
    x_MD = dispatch_rows(x_TD, send.expert_token_indices, send.token_index_map)
    w_M = top_k_weights.reshape(-1).index_select(0, send.expert_slot_indices.long())
    # the plan's splits come from the count exchange, so the ranks agree: no split check
    x_SD = all_to_all(x_MD, plan.recv_splits, plan.send_splits, group, check=False)
    w_S1 = all_to_all(w_M, plan.recv_splits, plan.send_splits, group, check=False)[:, None]
    del x_MD, w_M  # NOTE(memory): the sent copies are transient (M·d·D_t bytes not kept)
    # Weights are applied on the expert side: the fused path saves only x_SD and H, and its
    # weight gradient ⟨dO·w_downᵀ, A⟩ needs no saved expert output (MoEBlaze §5).
    if lora is None:
        y_SD = run_experts(x_SD, w_S1, recv, w_up_LDG, w_down_LND, activation=config.activation,
                           impl=config.experts_impl, backend=config.gemm_backend,
                           block_rows=block_rows, weight_grads=weight_grads)
    else:  # dropout masks follow the received rows (memfine.parallel.lora_experts)
        y_SD = run_lora_experts(x_SD, w_S1, recv, w_up_LDG, w_down_LND, lora,
                                activation=config.activation, backend=config.gemm_backend,
                                seed=seed, block_rows=block_rows,
                                weight_grads=weight_grads, quant=quant)
    y_MD = all_to_all(y_SD, plan.send_splits, plan.recv_splits, group, check=False)
    return combine_returned_rows(y_MD, send.expert_token_indices, send.token_index_map)


class ExpertParallelExperts(nn.Module):
    """This rank's L = E/ep experts, run on the tokens routed to them from the whole ``ep`` group.

    Parameters keep the names of :class:`memfine.nn.GroupedExperts`: ``w_up`` (E, d, G) and
    ``w_down`` (E, n, d) DTensors, ``Shard(0)`` over the ``ep`` mesh (local (L, d, G), (L, n, d):
    global experts ``context.local_experts(E)``).

    Args:
        config: the layer's :class:`MoEConfig` (E global).
        context: this rank's :class:`ParallelContext`.
        grad_scale: factor on the gradient of the local weights: data-parallel training
            passes 1/ep, as an expert's gradient sums its whole ``ep`` group's rows
            (:mod:`memfine.parallel.fsdp`, gradient scaling); 1.0 (default): the plain
            gradient of the summed loss.

    Attributes:
        transport_row_elements: d: every received row's copy of x stays alive beside the
            experts' own per-row bytes (the single-device memory model does not see it); ``run``
            hands it to the policy's decision (the experts contract, :mod:`memfine.nn.experts`).
        quant: this rank's 4-bit base (QLoRA, set by the LoRA subclass), or None.
        ep_model: True: a budget predicts with the expert-parallel timeline from the chunks' rows
            (False on the plain path and for the LoRA subclass, which it does not replay: the
            transport estimate).

    Raises:
        ValueError: if E is not divisible by ep.
    """

    def __init__(self, config: MoEConfig, context: ParallelContext, *,
                 grad_scale: float = 1.0) -> None:
        """Allocate this rank's zero-filled weights; arguments and exceptions as on the class."""
        super().__init__()
        check_expert_sharding(config.num_experts, context.ep_size)
        self.config, self.context, self.grad_scale = config, context, float(grad_scale)
        self.transport_row_elements = config.hidden_size
        self.quant: QuantizedBase | None = None
        self.ep_model = config.experts_impl == "fused"
        L = config.num_experts // context.ep_size
        self.w_up = self._shard(torch.zeros(L, config.hidden_size, config.up_width))
        self.w_down = self._shard(torch.zeros(L, config.intermediate_size, config.hidden_size))
        self.agree = functools.partial(agree_num_chunks, group=context.ep_group)

    def _shard(self, local: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(DTensor.from_local(local, self.context.ep_mesh, [Shard(0)],
                                               run_check=False))

    @classmethod
    def from_full(cls, w_up_EDG: torch.Tensor, w_down_END: torch.Tensor, config: MoEConfig,
                  context: ParallelContext, *, grad_scale: float = 1.0) -> ExpertParallelExperts:
        """Build from the full (E, d, G) / (E, n, d) weights, keeping this rank's slice (a copy).

        No communication: every rank holds the same full weights (same seed).
        """
        module = cls(config, context, grad_scale=grad_scale)
        local = context.local_experts(config.num_experts)
        module.w_up = module._shard(w_up_EDG.detach()[local.start:local.stop].clone())
        module.w_down = module._shard(w_down_END.detach()[local.start:local.stop].clone())
        return module

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(w_up_LDG, w_down_LND)``, views whose gradients carry ``grad_scale``."""
        return self.local(self.w_up), self.local(self.w_down)

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a (DTensor) parameter; its gradient carries ``grad_scale``."""
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        if self.grad_scale != 1.0 and local.requires_grad:
            local.register_hook(functools.partial(torch.mul, other=self.grad_scale))
        return local

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-rank counts summed over every rank of the global batch (all W ranks).

        Args:
            counts: (...,) int64 counts of this rank (e.g. tokens per expert).

        Returns:
            A new tensor on ``counts``' device.

        Side effects: one all-reduce SUM over the flattened ``dp`` mesh (every rank).
        """
        out = counts.detach().to(collective_device(self.context.ep_group), copy=True)
        dist.all_reduce(out, group=self.context.dp_mesh.get_group())
        return out.to(counts.device)

    def _choose(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, policy: ChunkPolicy
                ) -> tuple[ExpertCounts, ChunkPlan]:
        """Notify, then the plan: the policy's (c agreed over ``ep``) or the fixed c."""
        E, group = self.config.num_experts, self.context.ep_group
        if policy.budgeted:
            counts = exchange_counts(top_k_index, E, policy.config.bins, group)
            plan = policy.plan(counts.recv_tokens, x_TD.shape[0], compute_element_size(x_TD),
                               agree=self.agree,
                               transport_row_elements=self.transport_row_elements,
                               device_type=x_TD.device.type,
                               chunk_rows=chunk_rows_of(counts) if self.ep_model else None)
            if plan.num_chunks not in counts.candidates:  # a policy outside its bins: again
                counts = exchange_counts(top_k_index, E, (plan.num_chunks,), group)
            return counts, plan
        num_chunks = policy.config.num_chunks
        agree_num_chunks(num_chunks, group, require_equal=True)
        return exchange_counts(top_k_index, E, (num_chunks,), group), ChunkPlan(
            num_chunks, policy.ladder(x_TD.device.type, compute_element_size(x_TD))[0])

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, ChunkPlan]:
        """Run the EP experts on this rank's routed tokens; returns ``(out_TD, plan)``.

        Args:
            x_TD: (T, d) activations of this rank (T may differ between ranks, may be 0).
            top_k_index: (T, k) int64 global expert ids; ids ≥ E are sentinels (never sent).
            top_k_weights: (T, k) routing weights.
            policy: the layer's :class:`ChunkPolicy` (fixed c, equal on every rank, or MACT
                from s″ agreed with one all-reduce MAX over ``ep``) and its recompute mode.

        Returns:
            (T, d) output equal to the single-process experts on these tokens, and the
            :class:`ChunkPlan` it ran (c, and the row blocks a budget chose).

        Raises:
            ValueError: on shape mismatches, fixed chunk counts that differ between ranks, or
                from the policy (budget cannot be met).

        Side effects: collectives on the ``ep`` group (notify, agreement, per-chunk
        all-to-alls); every rank of the group calls it for the same layer, in the same order.

        Memory: with recompute ``experts``/``full``, a chunk keeps only its inputs (views of x
        and the weights) and its int32 plan; backward recomputes (re-issuing the chunk's
        all-to-alls with the plan's split sizes, no new count exchange) and back-propagates one
        chunk at a time, so the expert-side peak is one chunk's received rows. With ``none``, as
        :func:`ep_chunk_forward` for every chunk. With c > 1 on the fused path the chunks add
        their weight gradients into one buffer per local weight, as the local loop does.
        """
        self._check_inputs(x_TD, top_k_index, top_k_weights)
        counts, plan = self._choose(x_TD, top_k_index, policy)
        num_chunks, rows = plan.num_chunks, plan.block_rows
        assert rows is not None, "the policy resolves every call's rows per row block"
        plans = plan_chunks(top_k_index, counts, num_chunks, self.config.index_builder)
        # NOTE(memory): the local weights once per call; their aliases stay valid in recompute
        # (FSDP2 re-gathers into the same storage before backward), and the chunks share one
        # weight-gradient buffer per weight (L·d·G + L·n·d elements, not twice that).
        weights, buffers = share_chunk_weight_grads(
            self.local_weights(), num_chunks, in_place=self.config.experts_impl == "fused")
        chunk_fn = functools.partial(self._run_chunk, plans, weights, buffers, rows,
                                     *self._call_adapters())
        out_TD = run_chunked(chunk_fn, x_TD, top_k_index, top_k_weights, num_chunks=num_chunks,
                             recompute=policy.config.resolved_recompute)
        return out_TD, plan

    def _check_inputs(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> None:
        """Raise ValueError unless x is (T, d) and the routing (T, k) with the same T."""
        D = self.config.hidden_size
        if (x_TD.dim() != 2 or x_TD.shape[1] != D or top_k_index.dim() != 2
                or top_k_index.shape[0] != x_TD.shape[0]
                or top_k_weights.shape != top_k_index.shape):
            raise ValueError(f"expected hidden_states (T, d={D}), top_k_index and top_k_weights "
                             f"(T, k); got {tuple(x_TD.shape)}, {tuple(top_k_index.shape)}, "
                             f"{tuple(top_k_weights.shape)}")

    def _call_adapters(self) -> tuple[ExpertLoRA | None, int]:
        """This call's adapters and dropout seed: none (the LoRA experts override it)."""
        return None, 0

    def _run_chunk(self, plans: list[ChunkDispatch], weights: tuple[torch.Tensor, ...],
                   buffers: WeightGradBuffers | None, block_rows: int,
                   lora: ExpertLoRA | None, seed: int, chunk: int, x_CD: torch.Tensor,
                   top_k_index_CK: torch.Tensor, top_k_weights_CK: torch.Tensor) -> torch.Tensor:
        """The loop's chunk function: the chunk's frozen plan, the weights and any adapters."""
        w_up_LDG, w_down_LND = weights if self.quant is None else self.quant.stand_ins()
        return ep_chunk_forward(x_CD, top_k_weights_CK, w_up_LDG, w_down_LND, plans[chunk],
                                self.context.ep_group, self.config, buffers,
                                block_rows=block_rows, lora=lora,
                                seed=seed + chunk, quant=self.quant)
