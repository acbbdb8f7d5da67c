"""The MoE feed-forward layer: router → routing index → chunked experts → combine.

Legend: T tokens, K top-k slots, E experts, D = d.
Reference: docs/design.md §2-§4; MemFine §4 (chunked scheduling, MACT).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfine.config import ChunkConfig, MoEConfig, shared_block_rows
from memfine.config.lora import LoRAConfig
from memfine.experts import compute_element_size
from memfine.nn.experts import GroupedExperts
from memfine.nn.lora import LoRAGroupedExperts
from memfine.nn.shared import SharedExperts
from memfine.router_node import aux_losses, loss_counts, node_applies, route_with_losses
from memfine.routing import TopKRouter, check_token_mask
from memfine.routing.router import RoutingResult
from memfine.schedule.lora_policy import LoRAChunkPolicy
from memfine.schedule.policy import ChunkDecision, ChunkPolicy

# A layer built without a chunk config runs its experts in one piece without recomputation.
NO_CHUNKING = ChunkConfig(num_chunks=1, recompute="none")


@dataclass(frozen=True, slots=True)
class MoEAux:
    """Side outputs of one MoE layer call (computed once, outside any recompute).

    Attributes:
        load_balancing_loss: 0-dim fp32 Switch loss (1.0 when balanced).
        z_loss: 0-dim fp32 router z-loss.
        tokens_per_expert: (E,) int64 assignments per expert this call (kept pairs only).
        num_chunks: chunk count c used for the expert part (1 when unchunked).
        recompute: the recompute mode the call ran with (``none``, ``experts`` or ``full``).
        block_rows: the routed experts' rows per fused row block in the call (the policy's
            plan: the config's own, or a budget's smaller rung); None when no policy planned it.
        sequence_balance_loss: 0-dim fp32 DeepSeek-V3 sequence-wise balance loss; None when
            ``seq_aux_loss_coef`` is 0 (not computed).
        dropped_pairs: 0-dim int64 (token, slot) pairs dropped by capacity; None when dropless.
        selection_counts: (E + 1,) int64: the router's selection per expert over the valid
            tokens the losses' f counted (before capacity drops; summed over every rank), then
            the number of per-rank shares they sum (1 on one process, W under data/expert
            parallelism). Summed over a step's micro-batches it is the step's
            ``step_selection_counts`` (:meth:`MoELayer.forward`). Kept by calls without
            autograd only (the routing pre-pass); None when autograd records or the call was
            given step counts.
    """

    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_chunks: int = 1
    recompute: str = "none"
    block_rows: int | None = None
    sequence_balance_loss: torch.Tensor | None = None
    dropped_pairs: torch.Tensor | None = None
    selection_counts: torch.Tensor | None = None


class MoELayer(nn.Module):
    """Router + routed experts, run in c token chunks chosen by a :class:`ChunkPolicy`.

    Steps: (1) flatten x to (T, d) and zero padding rows by selection; (2) route once in fp32
    (outside every recomputed region); (3) ``experts.run``: the policy picks c (fixed, or MACT
    from the rows the experts receive) and the experts run chunk by chunk with the configured
    recomputation; (4) the aux losses over the global batch's valid tokens
    (``experts.global_counts``); (5) return the output and :class:`MoEAux` (losses are returned,
    never added silently). In eager training forwards (2) and (4) run first, as one autograd
    node (:class:`memfine.router_node.RouterNode`) that saves no (T, E) tensor and recomputes
    the router's logits in its backward; elsewhere they are a plain graph, (4) after (3).

    Expert parallelism swaps ``experts`` for :class:`memfine.parallel.ExpertParallelExperts`,
    which has the same ``run``/``global_counts`` contract; nothing else of the layer changes.

    Args:
        config: :class:`MoEConfig`. Its experiment knobs ``skew_hot_experts``/``skew_bias`` set
            the router's ``selection_bias`` (hot experts 0..h-1) at construction.
        depth: number of residual blocks of the model (output-projection init scale).
        chunk: chunking and recompute (:class:`ChunkConfig`); default :data:`NO_CHUNKING`.
        policy: a policy shared with other layers (instead of ``chunk``); its ``moe`` must equal
            ``config``.
        lora: optional :class:`LoRAConfig`: frozen expert weights with per-expert adapters
            (:class:`memfine.nn.lora.LoRAGroupedExperts`, split LoRA); the router is frozen
            unless ``lora.train_router``, the shared experts (and their gate) unless
            ``lora.train_attention``, as :func:`memfine.nn.lora.apply_lora` freezes them.

    Routing options of ``config`` (capacity, group limit, scaling, jitter) go to the router;
    shared experts (``num_shared_experts``) run on the same chunked path and are added to the
    routed output. The losses count the router's selection (before capacity drops).

    Raises:
        ValueError: if both ``chunk`` and ``policy`` are given, or the policy's MoE config differs.

    Attributes:
        policy: the :class:`ChunkPolicy`, passed to ``experts.run`` on every call (a
            whole-step plan, :class:`memfine.memory.step.StepPlanner`, may swap it per step).
        last_decision: the :class:`memfine.schedule.ChunkDecision` of the last eager forward
            (c, recompute mode, s″, predicted and budget bytes); None before the first.
    """

    def __init__(self, config: MoEConfig, *, depth: int = 1, chunk: ChunkConfig | None = None,
                 policy: ChunkPolicy | None = None, lora: LoRAConfig | None = None) -> None:
        """Build the router and experts; arguments and exceptions as on the class."""
        super().__init__()
        if chunk is not None and policy is not None:
            raise ValueError("MoELayer takes chunk or policy, not both")
        if policy is not None and policy.moe != config:
            raise ValueError(f"MoELayer policy.moe must equal config, got {policy.moe} vs {config}")
        self.config = config
        self.policy = policy or (ChunkPolicy(chunk or NO_CHUNKING, config) if lora is None
                                 else LoRAChunkPolicy(chunk or NO_CHUNKING, config, lora))
        self._last_record: Callable[[], ChunkDecision | None] = lambda: None
        self.router = TopKRouter(config.hidden_size, config.num_experts, config.top_k,
                                 score_func=config.score_func, renormalize=config.renormalize,
                                 options=config,
                                 jitter_eps=config.router_jitter_eps)
        self.experts = (GroupedExperts(config, depth=depth) if lora is None
                        else LoRAGroupedExperts(config, lora, depth=depth))
        if lora is not None:
            self.router.requires_grad_(lora.train_router)
        self.shared_experts = (SharedExperts(config, depth=depth)
                               if config.num_shared_experts else None)
        if lora is not None and self.shared_experts is not None:  # not adapted: frozen
            self.shared_experts.requires_grad_(lora.train_attention)
        if config.skew_hot_experts:
            with torch.no_grad():
                self.router.selection_bias[: config.skew_hot_experts] = config.skew_bias

    def forward(self, x: torch.Tensor, valid_mask: torch.Tensor | None = None, *,
                step_selection_counts: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MoEAux]:
        """Apply the layer.

        Args:
            x: (..., d) activations (e.g. (b, s, d)).
            valid_mask: optional mask of shape x.shape[:-1], bool or integer (Hugging Face's
                int64 0/1 ``attention_mask``: nonzero = a real token, tested on the device, no
                sync; float masks raise). Padding tokens are removed by selection (output rows
                exactly 0, no NaN propagation) and left out of counts and losses.
            step_selection_counts: optional (E + 1,) int64, the ``selection_counts`` of every
                micro-batch of the optimizer step summed (a routing pre-pass): the losses' f
                and token divisor are then the whole step's (gradient accumulation equals one
                larger batch with the balancing loss on), and no count collective runs.

        Returns:
            ``(out, aux)``: out has x's shape and dtype.

        Raises:
            ValueError: if x's last dimension is not d, the mask shape does not match or
                its dtype is floating, or
                ``step_selection_counts`` is not (E + 1,).
        """
        D = self.config.hidden_size
        if x.dim() < 1 or x.shape[-1] != D:
            raise ValueError(f"x must be (..., d) with d={D}, got {tuple(x.shape)}")
        x_TD = x.reshape(-1, D)
        mask_T = None
        if valid_mask is not None:
            if valid_mask.shape != x.shape[:-1]:
                raise ValueError(f"valid_mask must have x's token shape {tuple(x.shape[:-1])}, "
                                 f"got {tuple(valid_mask.shape)}")
            mask_T = check_token_mask(valid_mask.reshape(-1), x_TD.shape[0])
            x_TD = torch.where(mask_T[:, None], x_TD, torch.zeros((), dtype=x.dtype))
        E = self.config.num_experts
        if step_selection_counts is not None and tuple(step_selection_counts.shape) != (E + 1,):
            raise ValueError(f"step_selection_counts must be (E + 1,)=({E + 1},), got "
                             f"{tuple(step_selection_counts.shape)}")
        # tokens per sequence of the sequence-wise loss; None: not computed (coefficient 0)
        seq_len = ((x.shape[-2] if x.dim() >= 3 else x_TD.shape[0])
                   if self.config.seq_aux_loss_coef > 0 else None)
        aux: MoEAux | None = None
        if node_applies(self.router):  # one node: logits recomputed in backward (§2)
            decided, losses = route_with_losses(
                self.router, x_TD, mask_T, seq_len, self.experts.global_counts,
                step_selection_counts)
            aux = MoEAux(load_balancing_loss=losses.load_balancing, z_loss=losses.z,
                         tokens_per_expert=decided.tokens_per_expert,
                         sequence_balance_loss=losses.sequence,
                         dropped_pairs=decided.dropped_pairs)
            # NOTE(memory): the (T, E) logits and scores are dropped before the experts run
            index_TK, weights_TK = decided.top_k_index, decided.top_k_weights
            del decided
        else:
            routing = self.router(x_TD, mask_T)
            index_TK, weights_TK = routing.top_k_index, routing.top_k_weights
        out_TD, plan = self.experts.run(x_TD, index_TK, weights_TK, self.policy)
        num_chunks = plan.num_chunks
        if not torch.compiler.is_compiling():  # the policy's record of this call (host ints)
            self._last_record = self.policy.record()
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(
                x_TD, mask_T, num_chunks=num_chunks,
                recompute=self.policy.config.resolved_recompute, block_rows=shared_block_rows(
                    self.config, plan.block_rows, compute_element_size(x_TD), x_TD.device.type))
        if aux is None:
            aux = self._aux(routing, mask_T, seq_len, step_selection_counts)
        # Not a view: FSDP2 (and any autograd hook on the output) warns that an in-place op on a
        # returned view would skip its hooks. out_TD is this call's own fresh tensor, so sharing
        # its storage is safe; _unsafe_view reshapes without a copy (NOTE(memory): no T·d
        # clone) and without autograd view tracking (its backward is a reshape).
        out = torch.ops.aten._unsafe_view(out_TD, x.shape)
        return out, dataclasses.replace(aux, num_chunks=num_chunks,
                                        recompute=self.policy.config.resolved_recompute,
                                        block_rows=plan.block_rows)

    @property
    def last_decision(self) -> ChunkDecision | None:
        """The chunk count, recompute mode and memory prediction of the last eager forward.

        Returns:
            A frozen :class:`memfine.schedule.ChunkDecision`, or None before the first call
            (and for calls traced by ``torch.compile`` with a fixed c, which record nothing).
        """
        return self._last_record()

    def _aux(self, routing: RoutingResult, mask_T: torch.Tensor | None, seq_len: int | None,
             step_counts: torch.Tensor | None = None) -> MoEAux:
        """Aux losses over the global batch's valid tokens, as docs/design.md §2 defines them.

        One ``experts.global_counts`` call on (E + 1,) int64: the E selection counts and a 1
        per rank, so the sum also gives the number of shares W (ranks); the global valid tokens
        are Σ counts / k. Each share's loss is its tokens' sum divided by the mean valid tokens
        per share Σ counts / (k·W): the mean over the shares (what data-parallel gradient
        averaging computes) is the loss of one process holding the whole batch, whatever the
        valid tokens per rank. With ``step_counts`` (the step's micro-batches summed: W = ranks
        × micro-batches) they replace the call's own counts, so the mean over the micro-batches
        and ranks is the loss of the whole step's batch. When ``global_counts`` returns its
        argument (one process, no step counts) the losses are the local means (NOTE(memory): no
        divisor tensor is saved for backward, 4 bytes per loss, so saved bytes stay those of
        the memory model).

        The sequence-wise loss (only with ``seq_len``, given when ``seq_aux_loss_coef`` > 0)
        stays this rank's mean over its sequences: the mean over the ranks is the whole batch's
        when every rank holds as many sequences with valid tokens (the training loop's even
        batch split).
        """
        counts = loss_counts(routing, mask_T, self.experts.global_counts, step_counts)
        losses = aux_losses(routing.logits, routing.scores, routing.selected_index, mask_T,
                            seq_len, counts.counts_E, counts.tokens_per_rank)
        return MoEAux(
            load_balancing_loss=losses.load_balancing, z_loss=losses.z,
            tokens_per_expert=routing.tokens_per_expert,
            sequence_balance_loss=losses.sequence,
            dropped_pairs=routing.dropped_pairs,
            # NOTE(memory): kept only by forwards without autograd (the routing pre-pass): a
            # training forward holds no (E + 1)·8 bytes beyond the memory model's.
            selection_counts=(counts.global_stats
                              if step_counts is None and not torch.is_grad_enabled() else None),
        )

