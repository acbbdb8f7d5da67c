"""The module that owns the routed expert weights (one process).

The experts contract, shared with the expert-parallel experts
(:class:`memfine.parallel.ExpertParallelExperts`), so that sharding a model only swaps the
``experts`` submodule of each :class:`memfine.nn.MoELayer`:

- ``run(x_TD, top_k_index, top_k_weights, policy) -> (out_TD, plan)``: ask the chunk policy for
  a :class:`memfine.schedule.ChunkPlan` (c, and under a budget the fused row blocks) from the rows
  these experts receive (s″), then hand the module's own chunk step to the one chunk loop
  (:func:`memfine.schedule.chunked.run_chunked`). The step is where dispatch happens: here
  :meth:`GroupedExperts.run_chunk` builds the chunk's routing index and runs the fused experts;
  the expert-parallel step also moves the chunk's rows between ranks;
- ``global_counts(counts)``: per-rank counts summed over every rank of the global batch (the
  identity on one process), for the aux losses (docs/design.md §2);
- ``transport_row_elements``: elements per received row that the experts' transport keeps beside
  the expert computation (0 here; d for the expert-parallel experts, their received copy of x),
  which ``run`` hands to every chunk-count decision of the policy (the memory model's per-row
  bytes grow by it).

Legend: T tokens, K top-k slots, E experts, D = d, N = n, G = 2n (gated) or n.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from memfine.config import MoEConfig, Recompute, config_block_rows
from memfine.dispatch import build_routing_index
from memfine.experts import autocast_operands, compute_element_size, run_experts
from memfine.ops.weight_grads import WeightGradBuffers
from memfine.schedule.chunked import run_chunked, share_chunk_weight_grads
from memfine.schedule.policy import ChunkPlan, ChunkPolicy
from memfine.schedule.traced import traced_plan


class GroupedExperts(nn.Module):
    """E routed experts with weights ``w_up (E, d, G)`` and ``w_down (E, n, d)``.

    Args:
        config: the layer's :class:`MoEConfig` (activation, impl, backend, index builder).
        init_std: std of the normal init of w_up; w_down uses ``init_std / sqrt(2·depth)``.
        depth: number of residual blocks (scales the output projection init, GPT-2 style).

    Attributes:
        transport_row_elements: 0 (no transport: the rows never leave this process).
    """

    transport_row_elements = 0

    def __init__(self, config: MoEConfig, *, init_std: float = 0.02, depth: int = 1) -> None:
        """Allocate ``w_up``/``w_down`` and initialise them; arguments as on the class."""
        super().__init__()
        self.config = config
        E, D, N = config.num_experts, config.hidden_size, config.intermediate_size
        self.w_up = nn.Parameter(torch.empty(E, D, config.up_width))
        self.w_down = nn.Parameter(torch.empty(E, N, D))
        self.init_std, self.depth = init_std, depth
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init: w_up N(0, σ²), w_down N(0, (σ/√(2·depth))²)."""
        nn.init.normal_(self.w_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.init_std / math.sqrt(2 * self.depth))

    def run(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            policy: ChunkPolicy) -> tuple[torch.Tensor, ChunkPlan]:
        """Run the experts on routed tokens in the c chunks (and row blocks) ``policy`` chooses.

        Args:
            x_TD: (T, d) activations.
            top_k_index: (T, k) int64 expert ids from the router (sentinels ≥ E contribute 0).
            top_k_weights: (T, k) routing weights.
            policy: the layer's :class:`ChunkPolicy` (fixed c, or MACT from s″ = the valid
                (token, slot) pairs, its recompute mode).

        Returns:
            ``(out_TD, plan)``: (T, d) combined output and the :class:`ChunkPlan` it ran (c and
            its rows per row block, resolved by the policy).

        Raises:
            ValueError: from the policy when a budget cannot be met, or on shape mismatches.

        Memory: see :meth:`forward` for each recompute mode.
        Reference: MemFine Eq. 8-9, §4.
        """
        plan = self.plan(x_TD, top_k_index, policy)
        out_TD = self.forward(x_TD, top_k_index, top_k_weights, num_chunks=plan.num_chunks,
                              recompute=policy.config.resolved_recompute,
                              block_rows=plan.block_rows)
        return out_TD, plan

    def plan(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, policy: ChunkPolicy
             ) -> ChunkPlan:
        """This call's c and row blocks: the policy's (MemFine Eq. 8-9 under a budget).

        Under a budget s″ is read eagerly with one ``.item()`` and the policy predicts each
        (c, block) candidate's peak (:meth:`memfine.schedule.ChunkPolicy.decide`, recorded as
        ``last_decision``). While ``torch.compile`` traces, the plan comes from the policy's
        token thresholds compared with the symbolic T (:func:`memfine.schedule.traced.
        traced_plan`, planned from s″ ≤ T·k at the default row block): no graph break, one
        graph per bin in use, nothing recorded (docs/compile.md). A fixed c reads no count.

        Raises:
            ValueError: from the policy when the budget cannot be met (under compile, when the
                compiled call runs).
        """
        if not policy.budgeted:
            return policy.plan(0, x_TD.shape[0], compute_element_size(x_TD),
                               device_type=x_TD.device.type)
        if torch.compiler.is_compiling():
            return traced_plan(policy, x_TD, top_k_index)
        recv = self.received_rows(top_k_index)
        return policy.plan(recv, x_TD.shape[0], compute_element_size(x_TD),
                           transport_row_elements=self.transport_row_elements,
                           device_type=x_TD.device.type)

    def received_rows(self, top_k_index: torch.Tensor) -> int:
        """s″: (token, slot) pairs with an id in [0, E) (one ``.item()`` device sync)."""
        E = self.config.num_experts
        return int(((top_k_index >= 0) & (top_k_index < E)).sum().item())

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Counts of the global batch: on one process, ``counts`` itself.

        Args:
            counts: (..., ) int64 per-rank counts (e.g. tokens per expert).

        Returns:
            ``counts`` unchanged (the expert-parallel experts sum them over every rank).
        """
        return counts

    def forward(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, num_chunks: int = 1,
                recompute: Recompute = "none", block_rows: int | None = None) -> torch.Tensor:
        """Routed experts over c token chunks: dispatch → experts → combine per chunk.

        Args:
            x_TD: (T, d) activations.
            top_k_index: (T, k) int64 expert ids (sentinels ≥ E contribute zero).
            top_k_weights: (T, k) routing weights.
            num_chunks: c ≥ 1 contiguous token chunks (c > T allowed).
            recompute: ``none``, or ``experts``/``full`` to checkpoint every chunk
                (:mod:`memfine.schedule.chunked` says what each mode keeps).
            block_rows: the fused path's rows per row block (the policy's plan, as :meth:`run`
                passes it), or None for ``config.backward_block_bytes``'s (:meth:`call_block`).

        Returns:
            (T, d) combined expert output in x's dtype (the autocast dtype inside
            ``torch.autocast``: see :func:`memfine.experts.run.autocast_operands`), equal to the
            unchunked :func:`memfine.experts.run_experts` up to the summation order of the weight
            gradients.

        Raises:
            ValueError: as :func:`memfine.schedule.chunked.run_chunked` and
                :func:`memfine.experts.run_experts`.

        Memory: ``experts``/``full`` keep x_TD and the routing only; backward holds one chunk's
        H (S_c·G·D_t) and the fused backward's transients of one row block (see
        :class:`memfine.experts.FusedExpertsFunction`), with S_c the rows of the chunk. ``none``
        keeps every chunk's H (S·G·D_t in all); c = 1 with ``none`` is the plain call of
        :class:`memfine.experts.FusedExpertsFunction` (``fused``) or
        :func:`memfine.experts.experts_plain` (``plain``). With c > 1 on the fused path the chunks
        add their weight gradients into one shared buffer per weight
        (:mod:`memfine.ops.weight_grads`), so the weight gradients cost E·d·G + E·n·d
        once, as without chunking.
        Reference: MemFine §4; docs/design.md §4.
        """
        # Under torch.autocast: x and the weights are cast once per layer call, not per chunk.
        x_TD, w_up_EDG, w_down_END = autocast_operands(x_TD, self.w_up, self.w_down)
        weights, buffers = share_chunk_weight_grads(
            (w_up_EDG, w_down_END), num_chunks, in_place=self.config.experts_impl == "fused")
        step = functools.partial(self.run_chunk, weights, buffers,
                                 self.call_block(x_TD, block_rows))
        return run_chunked(step, x_TD, top_k_index, top_k_weights, num_chunks=num_chunks,
                           recompute=recompute)

    def call_block(self, x_TD: torch.Tensor, block_rows: int | None) -> int:
        """Rows per row block of a call: the plan's; None: the config's own at x's D_t."""
        return block_rows or config_block_rows(self.config, compute_element_size(x_TD),
                                               x_TD.device.type)

    def run_chunk(self, weights: tuple[torch.Tensor, ...], weight_grads: WeightGradBuffers | None,
                  block_rows: int, chunk: int, x_CD: torch.Tensor,
                  top_k_index_CK: torch.Tensor, top_k_weights_CK: torch.Tensor) -> torch.Tensor:
        """One chunk's dispatch → experts → combine (the chunk step of :meth:`forward`).

        Args:
            weights: ``(w_up_EDG, w_down_END)`` of this call (autocast, or the chunk loop's
                aliases from :func:`memfine.schedule.chunked.share_chunk_weight_grads`).
            weight_grads: the chunk loop's shared weight-gradient buffers, or ``None``.
            block_rows: the fused path's rows per row block.
            chunk: the chunk's index in [0, c) (not needed on one process).
            x_CD: (C, d) the chunk's activations.
            top_k_index_CK: (C, k) int64 expert ids of the chunk.
            top_k_weights_CK: (C, k) routing weights of the chunk.

        Returns:
            (C, d) combined output of the chunk.

        Memory: what :func:`memfine.experts.run_experts` saves for the chunk; recomputed whole in
        backward under ``experts``/``full`` (its routing index included).
        """
        index = build_routing_index(top_k_index_CK, self.config.num_experts,
                                    self.config.index_builder)
        w_up_EDG, w_down_END = weights
        return run_experts(x_CD, top_k_weights_CK, index, w_up_EDG, w_down_END,
                           activation=self.config.activation, impl=self.config.experts_impl,
                           backend=self.config.gemm_backend,
                           block_rows=block_rows, weight_grads=weight_grads)
