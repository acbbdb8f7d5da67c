"""The MoEBlaze fused expert Function, saving only x and H.

One Function runs gather → up-projection (+ bias) → activation → down-projection (+ bias) →
weighted combine.

Legend: T tokens, K top-k slots, S routed rows, E experts, D = d, N = n, G = 2n (gated) or n.
Reference: MoEBlaze (arXiv 2601.05296) §4-§5 (buffer-free dispatch, smart checkpointing);
docs/design.md §3, §5; docs/style.md §9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from memfine.activations import (
    Activation,
    activation_and_gate,
    activation_backward,
)
from memfine.experts.rows import (
    RowBlocks,
    add_token_rows_,
    block_tokens,
    expert_of_rows,
    forward_rows,
    row_blocks,
)
from memfine.lora.adapters import LoRABackward, LoRAForward, LoRASpec
from memfine.lora.quant import QuantizedBase
from memfine.ops.combine import scatter_slots
from memfine.ops.grouped import grouped_mm, grouped_row_sums
from memfine.ops.up_projection import up_input_grad
from memfine.ops.weight_grads import LOW_PRECISION_DTYPES, WeightGradBuffers

# Activations the Triton up-projection kernel computes in its epilogue.
TRITON_EPILOGUE_ACTIVATIONS = ("swiglu", "geglu", "silu", "gelu", "relu")
# Under torch.compile the backward runs as one block unless this is True: the traced row
# blocks (:func:`memfine.experts.rows.row_blocks`) equal eager but raised the compiled peak
# and time where measured (docs/compile.md, "The streamed backward under compile"). The traced
# forward is one block either way.
STREAM_UNDER_COMPILE = False
# The CPU sums the output rows (forward) and the dx rows (backward) with ``index_add_``
# (sequential, deterministic, fastest there); True makes it take the sorted ``index_put_`` that
# every other device takes (:func:`memfine.experts.rows.add_token_rows_`).
DEVICE_SUM_ON_CPU = False


def _row_dots(a_SN: torch.Tensor, b_SN: torch.Tensor) -> torch.Tensor:
    """(S,) per-row inner products ⟨a_r, b_r⟩ without an (S, n) product temporary."""
    return torch.bmm(a_SN.unsqueeze(1), b_SN.unsqueeze(2)).view(-1)


def _forward_triton(x_TD: torch.Tensor, weights_TK: torch.Tensor, w_up_EDG: torch.Tensor,
                    w_down_END: torch.Tensor, expert_token_indices_S: torch.Tensor,
                    offsets_E1: torch.Tensor, token_index_map_TK: torch.Tensor,
                    expert_slot_indices_S: torch.Tensor, activation: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, out) computed with the Triton kernels.

    The gather is fused into the up-projection with the activation in its epilogue, the routing
    weight is applied in the down-projection's epilogue, then a per-token combine sums the rows.
    """
    from memfine.triton_kernels import down_combine, gather_up

    h_SG, a_SN = gather_up(x_TD, w_up_EDG, expert_token_indices_S, offsets_E1, activation)
    w_S = weights_TK.reshape(-1).index_select(0, expert_slot_indices_S.long())
    return h_SG, down_combine(a_SN, w_down_END, offsets_E1, w_S, token_index_map_TK)


@dataclass(frozen=True, eq=False, slots=True)
class FusedOptions:
    """The non-tensor inputs of :class:`FusedExpertsFunction`, in one frozen structure.

    Attributes:
        activation: a name or a :class:`memfine.config.GatedActivation`.
        backend: grouped GEMM backend (``auto``, ``grouped_mm``, ``loop``, ``triton``).
        block_rows: rows per block of the streamed forward and backward (≥ 1; clamped to 1).
        weight_grads: the chunk loop's shared weight-gradient buffers, or None (the Function
            returns its own).
        lora: split-LoRA adapters (:class:`memfine.lora.adapters.LoRASpec`); their tensors
            follow the :data:`PARAMS` in ``params``. None: no adapters.
        host_offsets: the E + 1 expert_token_offsets as Python ints, read once in the forward
            (:attr:`memfine.dispatch.RoutingIndex.host_offsets`), so the backward makes no host
            read; None: the backward reads them once itself (eager) or runs the traced path.
        quant: a frozen 4-bit base (:class:`memfine.lora.quant.QuantizedBase`) read in place
            of the w_up / w_down inputs (passed as None), each row block dequantising its
            experts; None: the inputs are the weights.
    """

    activation: Activation
    backend: str = "auto"
    block_rows: int = 2**62
    weight_grads: WeightGradBuffers | None = None
    host_offsets: tuple[int, ...] | None = None
    lora: LoRASpec | None = None
    quant: QuantizedBase | None = None


# The expert parameters, in the order FusedExpertsFunction takes them after the index arrays
# (each may be None except w_up and w_down); split-LoRA adapter tensors (FusedOptions.lora)
# follow them.
PARAMS = ("w_up", "w_down", "b_up", "b_down", "w_up_second")


class FusedExpertsFunction(torch.autograd.Function):
    """Routed experts with minimal saved activations.

    forward(options, x_TD, weights_TK, expert_token_indices_S, expert_token_offsets_E1,
    token_index_map_TK, expert_slot_indices_S, *params) → out_TD (T, d) with
    out[t] = Σ_j w[t,j] · (act(x[t]·w_up[e] + b_up[e])·w_down[e] + b_down[e]), e = e_tj.
    ``options`` is a :class:`FusedOptions` (activation, backend, block rows, shared weight-gradient
    buffers, host offsets); ``params`` follow :data:`PARAMS`: ``w_up_EDG``, ``w_down_END``,
    ``b_up_EG`` (E, G), ``b_down_ED`` (E, d), ``w_up_second_EDN``; the biases are optional
    (None: no bias); the activation is a name or a
    :class:`memfine.config.GatedActivation` (e.g. GPT-OSS's clamped, interleaved SwiGLU).

    ``w_up_second_EDN`` (E, d, n) is None or the up half of a gated
    up-projection held as its own tensor; ``w_up_EDG`` is then the (E, d, n) gate half and
    H = [x·w_up | x·w_up_second], exactly as if the two were one concatenated tensor
    (torchtitan's separate ``w1``/``w3``; :mod:`memfine.ops.up_projection`). With two halves
    the Triton path runs its grouped GEMM per half, not the fused gather-up kernel.

    Saved for backward (D_t = bytes per element of x):
        - x_TD: T·d·D_t bytes (the layer input, never a gathered copy);
        - H: S·G·D_t bytes (pre-activation, bias included; G = 2n for gated activations,
          n for GELU/ReLU/SiLU), one (B, G) tensor per row block, as the forward wrote it;
          in fp32/float64 a block's H is freed in backward once its dH exists (``set_()``, so
          a later read fails loudly), unless the backward keeps the graph (``retain_graph``);
        - weights_TK: T·k·D_t bytes (routing weights, already in x's dtype);
        - the int32 index arrays expert_token_indices (S), expert_slot_indices (S),
          token_index_map (T·k), expert_token_offsets (E + 1): 4·(2·S + T·k + E + 1) bytes;
        - w_up, w_down and the biases: parameters, not activations (no extra bytes; a bias
          adds no saved activation).
        Total activation bytes: (T·d + S·G + T·k)·D_t + 4·(2·S + T·k + E + 1); with S = T·k and
        a gated activation that is the no-recompute floor (T·d + 2·T·k·n) elements
        (docs/design.md §5) plus the weights and indices. Not kept: the gathered x (S·d), A (S·n),
        Y (S·d), the (T, k, d) scattered copy, the per-row biases.

    Recomputed in backward:
        the gathered rows x[expert_token_indices] and dO[expert_token_indices] and A = act(H).
        The routing-weight gradient is dw_(t,j) = ⟨dO_t·w_downᵀ, A_r⟩ + ⟨dO_t, b_down[e]⟩, so Y
        is never needed. The bias gradients are per-expert segment sums:
        db_up[e] = Σ_{rows of e} dH_r, db_down[e] = Σ_{rows of e} w_r·dO_t.

    Streamed forward (:func:`memfine.experts.rows.forward_rows`): the forward walks the same
    row blocks as the backward. Per block of B rows it gathers the block's x rows, keeps its H
    rows (+ bias) as the block's saved tensor (no copy), computes A and Y for them and adds
    w ⊙ Y into out per token (``index_add_`` on the CPU, the sorted ``index_put_`` elsewhere),
    so no (S, d) gathered copy, no (S, n) A, no (S, d) Y and no (T, k, d) scattered copy is
    ever live. Forward transients: out (T·d), the rows' routing weights (S), with several
    blocks their (n_blocks, E + 1) int32 offsets; per block x rows (B·d), A (B·n), Y (B·d)
    and w ⊙ Y (B·d) (its H rows, B·G, are kept).
    The bookkeeping (w_S, block offsets) is built once per pass, in forward and again in
    backward, never saved.
    Split LoRA and a forward traced by torch.compile (whose S is data-dependent) run the
    forward as one block.

    Streamed backward (MoEBlaze §4.2, row tiles of the expert-grouped rows): backward walks the
    S rows in blocks [r0, r1) of ``block_rows`` rows (a plain row tile that may cut an expert;
    the block's grouped offsets are clamp(offsets, r0, r1) − r0). Per block it recomputes A,
    forms dA, dH and the gathered rows, adds the block's products into the weight gradients
    (bf16: 2-D × 2-D ``torch._grouped_mm`` products, column-major A = Xᵀ and row-major B; the
    first block's over all E experts is the buffer, a later block's covers only its experts and
    is copied into their slices, and an expert cut by a block edge is summed in fp32 and rounded
    once; fp32/float64: per-expert ``addmm_`` in place; ``WeightGradBuffers.write_block_``)
    and its dx rows into dx (T, d) deterministically: on
    the CPU with ``index_add_`` over expert_token_indices (a sequential sum in expert-grouped row
    order), elsewhere with ``index_put_(accumulate=True)``, whose CUDA kernel sorts, no atomics
    (:func:`memfine.experts.rows.add_token_rows_`). ``weight_grads``: the chunk loop's shared
    buffers (:mod:`memfine.ops.weight_grads`); the w_up / w_down gradients then go into
    them and None
    is returned for those inputs. Otherwise the Function owns its buffers and returns them.

    Backward transients: per block of B rows, dO rows (B·d), dA (B·n), A (B·n), f(gate) (B·n,
    gated activations: recomputed once for A and reused for dH), dH (B·G), gathered x (B·d),
    dx rows (B·d), the block's int64 tokens on the CPU (B·8 bytes), the activation's
    temporaries (B·n each) and, with a down
    bias, its (B, d) rows; for the whole call, dx (T·d), the row dots (S) and the weight
    gradient buffers (E·d·G + E·n·d; in bf16 each block after the first adds a transient
    product of ⌈E·B/S⌉ + 2 experts, and an expert cut by a block edge an fp32 (I, O) sum and
    its rows in fp32), the rows' routing weights (S) and, with several blocks, their
    (n_blocks, E + 1) int32 offsets. No (S, ·)
    array and no (T, k, d) gather exists in backward when B < S. The per-expert ``addmm_``
    ranges come from the offsets the index builder read in the forward
    (``FusedOptions.host_offsets``): the backward makes no host read (an index without them
    costs one read per backward).

    With ``backend="triton"``, a named activation and no biases, the forward gathers x inside the
    up-projection kernel (SwiGLU or the plain activation in its epilogue) and applies the routing
    weights in the down-projection epilogue before a per-token combine kernel; otherwise the
    Triton grouped GEMM runs the same steps as the other backends.

    """

    @staticmethod
    def forward(ctx: Any, options: FusedOptions, x_TD: torch.Tensor, weights_TK: torch.Tensor,
                expert_token_indices_S: torch.Tensor, expert_token_offsets_E1: torch.Tensor,
                token_index_map_TK: torch.Tensor, expert_slot_indices_S: torch.Tensor,
                *params: torch.Tensor | None) -> torch.Tensor:
        """Compute out_TD (T, d) in x's dtype; save x, H, routing weights, weights, indices.

        Arguments, saved tensors and their bytes are described on the class.
        """
        w_up_EDG, w_down_END, b_up_EG, b_down_ED, w_up_second_EDN = params[:len(PARAMS)]
        if options.quant is not None:  # 4-bit base: w[held] dequantises a block's experts
            w_up_EDG, w_down_END = options.quant.weights()
        # the adapter tensors, never None (only the biases and the second up half may be)
        lora_weights = cast(tuple[torch.Tensor, ...], params[len(PARAMS):])
        lora_fwd = (None if options.lora is None
                    else LoRAForward(options.lora, lora_weights, options.backend))
        assert w_up_EDG is not None and w_down_END is not None, "w_up and w_down are required"
        parts = (w_up_EDG,) if w_up_second_EDN is None else (w_up_EDG, w_up_second_EDN)
        activation, backend = options.activation, options.backend
        no_bias = b_up_EG is None and b_down_ED is None
        if (backend == "triton" and no_bias and activation in TRITON_EPILOGUE_ACTIVATIONS
                and len(parts) == 1 and lora_fwd is None and options.quant is None):
            h_SG, out_TD = _forward_triton(x_TD, weights_TK, w_up_EDG, w_down_END,
                                           expert_token_indices_S, expert_token_offsets_E1,
                                           token_index_map_TK, expert_slot_indices_S, activation)
            h_blocks: tuple[torch.Tensor, ...] = (h_SG,)
        else:  # streamed over row blocks (under torch.compile, S data-dependent: one block)
            traced = torch.compiler.is_compiling()
            blocks = _plan_rows(options, x_TD, weights_TK, expert_token_offsets_E1,
                                expert_slot_indices_S, traced, one_block=traced,
                                host=_sliced(options, options.host_offsets, b_up_EG, b_down_ED))
            h_blocks, out_TD = forward_rows(x_TD, blocks, parts, w_down_END, b_up_EG, b_down_ED,
                                        expert_token_indices_S, activation,
                                        backend, by_sort=_by_sort(x_TD), lora=lora_fwd)
            del blocks  # NOTE(memory): w_S and the block offsets are rebuilt in backward
        lora_saved = lora_fwd.to_save(lora_weights, x_TD) if lora_fwd else ()
        # NOTE(memory): saves x (T·d) + H (S·G, per block) + weights (T·k) elements + int32
        # indices only; the biases are parameters (saved by reference, no activation bytes).
        ctx.save_for_backward(x_TD, *h_blocks, weights_TK, expert_token_indices_S,
                              expert_token_offsets_E1, token_index_map_TK,
                              expert_slot_indices_S, *params[:len(PARAMS)], *lora_saved)
        ctx.options, ctx.num_lora_saved, ctx.num_h = options, len(lora_saved), len(h_blocks)
        return out_TD

    @staticmethod
    def backward(ctx: Any, grad_out_TD: torch.Tensor) -> tuple[Any, ...]:
        """Gradients of x, the routing weights and the :data:`PARAMS` from dO (T, d).

        Streams over row blocks of ``options.block_rows`` expert-grouped rows (see the class);
        a gradient whose input does not need one is None, as are the entries of the options and
        the index arrays. With shared ``weight_grads`` the w_up / w_down gradients go into those
        buffers and None is returned for them.

        Raises:
            RuntimeError: under ``create_graph=True`` (double backward: the streamed backward
                writes into buffers in place, which autograd cannot differentiate).
        """
        if torch.is_grad_enabled():
            raise RuntimeError("memfine's fused experts have no double backward: "
                               "create_graph=True is not supported; run_experts(impl='plain', "
                               "backend='grouped_mm') is twice differentiable (MoELayer is not: "
                               "its router node differentiates once)")
        st = _BackwardState(ctx, grad_out_TD)
        st.blocks = _plan_rows(ctx.options, st.x_TD, st.weights_TK, st.offsets_E1, st.slot_S,
                               st.bounds is None,
                               host=_sliced(ctx.options, st.bounds, st.b_up_EG, st.b_down_ED))
        if len(st.h_blocks) not in (1, len(st.blocks.bounds)):  # blocks differ from forward's
            st.h_blocks = (torch.cat(st.h_blocks),)
        # NOTE(memory): one fp32/float64 H tensor per block: each is freed once its dH exists
        # (bf16/fp16 keep H to the end: their spanning experts' fp32 casts, which the memory
        # model sizes as one balanced expert's rows, would then set the peak)
        st.free_h = (len(st.h_blocks) == len(st.blocks.bounds) and st.bounds is not None
                     and st.x_TD.dtype not in LOW_PRECISION_DTYPES and not _keep_graph())
        for b, (r0, r1) in enumerate(st.blocks.bounds):
            _backward_block(st, b, r0, r1)
        grad_weights = None
        if st.dots_S is not None:  # allocated when the routing weights need a gradient
            grad_weights = scatter_slots(st.dots_S, st.slot_S, tuple(st.weights_TK.shape))
        own = ctx.options.weight_grads is None  # else the chunk loop's wrapper hands them over
        grad_up = st.grads.take(0, st.w_up_EDG) if st.need_up[0] and own else None
        grad_down = st.grads.take(1, st.w_down_END) if st.need_down and own else None
        grad_up_second = None
        if len(st.parts) == 2 and st.need_up[1]:  # the up half: slot 2, never shared
            grad_up_second = st.grads.take(2, st.parts[1])
        # None: options, expert_token_indices, expert_token_offsets, token_index_map,
        # expert_slot_indices; then the PARAMS and the adapters' gradients
        grads = (None, st.grad_x_TD, grad_weights, None, None, None, None,
                 grad_up, grad_down, st.grad_b_up, st.grad_b_down, grad_up_second,
                 *(st.lora.take_grads() if st.lora else ()))
        return grads[:len(ctx.needs_input_grad)]


def _sliced(options: FusedOptions, bounds: Any, b_up: torch.Tensor | None,
            b_down: torch.Tensor | None) -> list[int] | None:
    """Host offsets when each block's GEMMs take only its experts' weights.

    Not with a bias, nor with LoRA unless the base is 4-bit.
    """
    if (bounds is None or (options.lora is not None and options.quant is None)
            or b_up is not None or b_down is not None):
        return None
    return list(bounds)


def _plan_rows(options: FusedOptions, x_TD: torch.Tensor, weights_TK: torch.Tensor,
               offsets_E1: torch.Tensor, slot_S: torch.Tensor, traced: bool, *,
               one_block: bool = False, host: list[int] | None = None) -> RowBlocks:
    """The row blocks of one pass (forward or backward) and their bookkeeping, built once.

    Blocks of ``options.block_rows`` rows (:func:`memfine.experts.rows.row_blocks`; under
    torch.compile one block unless :data:`STREAM_UNDER_COMPILE`); ``one_block``: all S rows.
    The forward and the backward build the same blocks (nothing is kept between them).
    ``host``: the host offsets with which a block's GEMMs take only its experts
    (:meth:`memfine.experts.rows.RowBlocks.experts_of`).
    """
    S = slot_S.shape[0]
    block_rows = 2**62 if one_block else max(1, options.block_rows)
    bounds = row_blocks(S, weights_TK.numel(), block_rows, traced,
                        STREAM_UNDER_COMPILE and not one_block)
    return RowBlocks.plan(bounds, block_rows, offsets_E1, weights_TK, slot_S, not traced,
                          None if traced else host)


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``): saved H then stays.

    Unknown (no such query in this torch): kept.
    """
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


def _by_sort(x_TD: torch.Tensor) -> bool:
    """Rows are summed per token by sorted ``index_put_`` off the CPU (or with the flag)."""
    return x_TD.device.type != "cpu" or DEVICE_SUM_ON_CPU


class _BackwardState:
    """Saved tensors, gradient flags and the gradient accumulators of one fused backward."""

    def __init__(self, ctx: Any, grad_out_TD: torch.Tensor) -> None:
        saved = ctx.saved_tensors
        n_base = len(saved) - ctx.num_lora_saved
        self.x_TD, num_h = saved[0], ctx.num_h
        self.h_blocks: tuple[torch.Tensor, ...] = saved[1:1 + num_h]  # H rows per forward block
        (self.weights_TK, self.token_idx_S, self.offsets_E1, map_TK, self.slot_S,
         self.w_up_EDG, self.w_down_END, self.b_up_EG, self.b_down_ED,
         second) = saved[1 + num_h:n_base]
        if ctx.options.quant is not None:  # the frozen 4-bit base (no gradient)
            self.w_up_EDG, self.w_down_END = ctx.options.quant.weights()
        # NOTE(memory): token_index_map is not read by backward; a checkpoint's recomputed
        # copy is freed as soon as it is unpacked (T·k·4 bytes)
        del map_TK
        options: FusedOptions = ctx.options
        self.parts = (self.w_up_EDG,) if second is None else (self.w_up_EDG, second)
        self.act, self.backend = options.activation, options.backend
        need = ctx.needs_input_grad
        self.need_x, self.need_w = need[1], need[2]
        self.need_down, self.need_b_up, self.need_b_down = need[8], need[9], need[10]
        self.need_up = (need[7], second is not None and need[11])
        self.grad_out_TD = grad_out_TD.contiguous()
        self.grads = options.weight_grads or WeightGradBuffers()
        # E + 1 host ints: the per-expert addmm_ ranges, read once in the forward (the index's
        # host_offsets; no host sync here) or, for an index built without them, once here.
        # Under torch.compile host values are unknown while tracing, so the backward runs as
        # one block with grouped weight GEMMs.
        self.bounds: list[int] | None = None
        if not torch.compiler.is_compiling():
            self.bounds = (list(options.host_offsets) if options.host_offsets is not None
                           else self.offsets_E1.tolist())
        first_lora = 7 + len(PARAMS)  # options, x, weights, 4 index arrays, PARAMS
        self.lora = None if options.lora is None else LoRABackward(
            options.lora, saved[n_base:], need[first_lora:], self.x_TD, self.token_idx_S,
            self.bounds, self.backend)
        E, S = self.w_up_EDG.shape[0], self.slot_S.shape[0]
        # NOTE(memory): the outputs are filled block by block: dx (T·d), the row dots (S), the
        # bias gradients (E·G, E·d); no (S, ·) array outlives a block.
        self.grad_x_TD = torch.zeros_like(self.x_TD) if self.need_x else None
        self.dots_S = self.x_TD.new_empty(S) if self.need_w else None
        self.grad_b_up = (self.x_TD.new_zeros(E, self.h_blocks[0].shape[1]) if self.need_b_up
                          else None)
        self.grad_b_down = (self.x_TD.new_zeros(E, self.x_TD.shape[1]) if self.need_b_down
                            else None)
        self.blocks: RowBlocks | None = None  # the row blocks, planned once per backward
        self.free_h = False  # free each block's H after its dH (set once the blocks are known)


def _backward_block(st: _BackwardState, b: int, r0: int, r1: int) -> None:
    """Back-propagate expert-grouped rows [r0, r1): A, dA, dH and the rows exist for them only.

    The block's grouped offsets are clamp(offsets, r0, r1) − r0 (computed for every block at
    once, :meth:`memfine.experts.rows.RowBlocks.plan`; no host copy needed for the GEMMs); weight
    gradients go into the buffers (one grouped GEMM per weight in bf16, else per expert), dx
    per token. Rows are gathered by the block's tokens (:func:`memfine.experts.rows.block_tokens`:
    int64 on the CPU's path, B·8 bytes, the int32 slice on a device's).
    """
    E = st.w_up_EDG.shape[0]
    assert st.blocks is not None, "the blocks are planned before they run"
    S = st.slot_S.shape[0]
    offs_E1 = st.blocks.offsets_of(b, r0, r1, S)
    # the block's experts only (several blocks, no bias, no LoRA: else all E)
    held_offs, held = st.blocks.experts_of(b, r0, r1, S)
    token_B = block_tokens(st.token_idx_S, r0, r1, _by_sort(st.x_TD))
    h_BG = st.h_blocks[0][r0:r1] if len(st.h_blocks) == 1 else st.h_blocks[b]
    w_B1 = st.blocks.w_S[r0:r1, None]
    # NOTE(memory): transient B·d
    grad_out_BD = st.grad_out_TD.index_select(0, token_B)
    grad_a_BN = grouped_mm(grad_out_BD, st.w_down_END[held].transpose(1, 2), held_offs,
                           st.backend)
    # NOTE(memory): A and f(gate) recomputed from H for this block only (transients B·n each)
    need_a = st.need_w or st.need_down or (st.lora is not None and st.lora.needs_activation)
    a_BN, gate_BN = activation_and_gate(h_BG, st.act) if need_a else (None, None)
    if st.lora is not None:  # the down adapter's term of dA (before the dots use dA)
        st.lora.down_block(r0, r1, offs_E1, grad_out_BD, grad_a_BN, a_BN, w_B1)
    if st.dots_S is not None and st.b_down_ED is not None:  # ⟨dO, b_down⟩, before dO ⊙ w
        bias_BD = st.b_down_ED.index_select(0, expert_of_rows(offs_E1, r1 - r0))
        st.dots_S[r0:r1] = _row_dots(grad_out_BD, bias_BD)
    if st.need_down or st.need_b_down:
        grad_out_BD.mul_(w_B1)  # (w ⊙ dO) rows
        if st.need_down:  # dW_down[e] += A_eᵀ · (w ⊙ dO)_e, in place
            assert a_BN is not None, "A is recomputed when w_down needs a gradient"
            st.grads.write_block_(1, st.w_down_END, a_BN, grad_out_BD, st.bounds, r0, offs_E1,
                                 st.backend)
        if st.grad_b_down is not None:  # db_down[e] += Σ_{rows of e} (w ⊙ dO)
            st.grad_b_down += grouped_row_sums(grad_out_BD, offs_E1, E)
    if st.dots_S is not None:  # ⟨dO·w_downᵀ, A⟩ (MoEBlaze §5): no Y needed
        assert a_BN is not None, "A is recomputed when the weights need a gradient"
        # NOTE(memory): the products overwrite A (used above), so the dots need no temporary
        if st.b_down_ED is None:
            torch.sum(a_BN.mul_(grad_a_BN), 1, out=st.dots_S[r0:r1])
        else:
            st.dots_S[r0:r1] += a_BN.mul_(grad_a_BN).sum(1)
    del a_BN, grad_out_BD
    grad_h_BG = activation_backward(h_BG, grad_a_BN.mul_(w_B1), st.act, gate_BN)  # B·G
    del grad_a_BN, gate_BN
    if st.free_h:  # NOTE(memory): the block's H (B·G) is read no more: its storage goes now
        st.h_blocks[b if len(st.h_blocks) > 1 else 0].set_()  # type: ignore[call-overload]
    del h_BG
    if st.grad_b_up is not None:
        st.grad_b_up += grouped_row_sums(grad_h_BG, offs_E1, E)
    if any(st.need_up):  # dW_up[e] += x_eᵀ · dH_e (per part: its columns of dH), in place
        x_BD = st.x_TD.index_select(0, token_B)  # NOTE(memory): recomputed gather, B·d
        col = 0
        for slot, part, needed in zip((0, 2), st.parts, st.need_up, strict=False):
            width = part.shape[2]
            if needed:
                st.grads.write_block_(slot, part, x_BD, grad_h_BG[:, col:col + width],
                                     st.bounds, r0, offs_E1, st.backend)
            col += width
        del x_BD
    lora_dx_BD = (None if st.lora is None
                  else st.lora.up_block(r0, r1, offs_E1, grad_h_BG, st.grad_x_TD is not None))
    if st.grad_x_TD is not None:  # dx[t] += dH_r · w_upᵀ for the block's rows r of t
        grad_x_BD = up_input_grad(grad_h_BG, tuple(p[held] for p in st.parts), held_offs,
                                  st.backend)
        if lora_dx_BD is not None:
            grad_x_BD.add_(lora_dx_BD)
        add_token_rows_(st.grad_x_TD, grad_x_BD, token_B, _by_sort(grad_x_BD))
        del grad_x_BD
