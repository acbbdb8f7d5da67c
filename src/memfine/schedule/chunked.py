"""Token-chunked execution of the MoE expert part with per-chunk recomputation (MemFine §4).

The router runs once on all T tokens, outside this module. The tokens are split into c contiguous
chunks; each chunk runs dispatch (its own :class:`~memfine.dispatch.RoutingIndex`) → experts →
combine, and the chunk outputs are concatenated. With recomputation every chunk runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, so backward recomputes and
back-propagates one chunk at a time and the expert part's peak is that of one chunk, not of the
whole layer.

Recompute modes (:data:`memfine.config.Recompute`), what survives forward for backward:

- ``none``: no checkpointing. Every chunk saves what its expert path saves (fused: the chunk's H,
  S_c·G elements, plus the int32 index arrays), so saved bytes add up to the unchunked ones;
  chunking still bounds the forward transients (gathered x, A, Y: S_c rows each) and the
  backward transients (dH, dA, dx rows) by one chunk.
- ``experts``: every chunk is checkpointed. Only the layer input ``x_TD`` and the routing
  (``top_k_index`` int64, ``top_k_weights``) survive forward; the routing index, H and everything
  else of a chunk are rebuilt in backward, one chunk at a time.
- ``full``: here exactly as ``experts``; the transformer block
  (:class:`memfine.nn.model.Block`) additionally checkpoints its attention sub-layer, so a block
  keeps only its input, the router input and the routing (see ``Block``).

Recomputation never re-decides routing: the routing tensors are inputs of every checkpointed
region and are reused as they are (docs/design.md §2, docs/style.md §9).

Legend: T tokens, C tokens of one chunk, K top-k slots, E experts, D = d, S routed rows,
G = 2n (gated) or n.
Reference: MemFine (arXiv 2511.21431) §4 (chunked scheduling); docs/design.md §4-§5.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from memfine.config import RECOMPUTE_MODES, Recompute
from memfine.ops.weight_grads import WeightGradBuffers, share_weight_grads

ChunkFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""One chunk's expert part: ``(chunk, x_CD, top_k_index_CK, top_k_weights_CK) -> out_CD``.

``chunk`` is the chunk's position i in [0, c): an expert-parallel chunk function looks up the
chunk's frozen dispatch plan by it (the same plan in forward and in recompute)."""


def chunk_sizes(num_tokens: int, num_chunks: int) -> list[int]:
    """Split T tokens into c contiguous chunks as evenly as possible.

    Args:
        num_tokens: T ≥ 0.
        num_chunks: c ≥ 1 (may exceed T: the trailing chunks are then empty).

    Returns:
        c chunk lengths in tokens; the first ``T mod c`` chunks hold ⌈T/c⌉ tokens, the rest
        ⌊T/c⌋ (as ``torch.tensor_split``). They sum to T.

    Raises:
        ValueError: if num_tokens < 0 or num_chunks < 1.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    # ⌊(T + c - 1 - i) / c⌋ is ⌈T/c⌉ for i < T mod c and ⌊T/c⌋ after: one floor division per
    # chunk, no divmod and no comparison with T mod c, so a symbolic T (torch.compile with
    # dynamic shapes) gives symbolic sizes without a guard per value of T.
    return [(num_tokens + num_chunks - 1 - i) // num_chunks for i in range(num_chunks)]


def _check_chunk_inputs(x_TD: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, recompute: str) -> None:
    """Raise ValueError on an unknown recompute mode or (T, d) / (T, k) shapes that disagree."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if x_TD.dim() != 2:
        raise ValueError(f"x must be (T, d), got {tuple(x_TD.shape)}")
    T = x_TD.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index must be (T, k) with T={T}, got {tuple(top_k_index.shape)}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights must be (T, k)={tuple(top_k_index.shape)}, "
                         f"got {tuple(top_k_weights.shape)}")


def share_chunk_weight_grads(weights: tuple[torch.Tensor, ...], num_chunks: int, *,
                             in_place: bool
                             ) -> tuple[tuple[torch.Tensor, ...], WeightGradBuffers | None]:
    """The expert weights the c chunks compute with, and their shared weight-gradient buffers.

    With c > 1, eagerly, and a chunk step that adds its weight gradients into given buffers
    (``in_place``) the chunks get aliases of ``weights`` from
    :func:`memfine.ops.weight_grads.share_weight_grads` and add their weight gradients
    into one buffer per weight; the weights' own gradient (and every hook on them, e.g. FSDP2's
    reduce-scatter) then arrives once per layer call. Otherwise the weights themselves and
    ``None``. Each experts module says whether its chunk step writes in place
    (:class:`memfine.nn.GroupedExperts`, :class:`memfine.parallel.ExpertParallelExperts`).

    Args:
        weights: the expert weights in slot order (w_up, w_down): (E, d, G) and (E, n, d), or a
            rank's (L, d, G) and (L, n, d).
        num_chunks: c ≥ 1.
        in_place: True when the chunk step hands the buffers on to a backward that adds into
            them (:func:`memfine.experts.run_experts`' fused path).

    Returns:
        ``(weights_for_chunks, buffers)``; the chunk step passes ``buffers`` on as
        ``weight_grads`` of :func:`memfine.experts.run_experts`.

    Memory: NOTE(memory): one weight-gradient buffer per weight for all c chunks; the engine
    would otherwise hold a chunk's gradient and the running sum at once (2·(E·d·G + E·n·d)
    elements instead of E·d·G + E·n·d).
    """
    # Under torch.compile the shared buffers (Python-side state mutated inside checkpointed
    # regions) are not traceable: the engine sums the chunks' weight gradients instead.
    if num_chunks > 1 and in_place and not torch.compiler.is_compiling():
        return share_weight_grads(weights)
    return weights, None


def run_chunked(chunk_fn: ChunkFn, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, num_chunks: int,
                recompute: Recompute = "experts") -> torch.Tensor:
    """Run ``chunk_fn`` on c contiguous token chunks and concatenate the results.

    The one chunk loop of memfine. Each experts module owns its chunk step and hands it in:
    :class:`memfine.nn.GroupedExperts` (dispatch → experts → combine on this process), the
    expert-parallel experts (:class:`memfine.parallel.ExpertParallelExperts`, whose step also
    does the chunk's all-to-alls: every rank must then use the same ``num_chunks``, see
    :class:`memfine.schedule.policy.ChunkPolicy`) and the transformers experts backend
    (:mod:`memfine.hf.experts`). Every one of the c chunks
    runs, empty ones included (c > T, or T = 0 on this rank), so collectives inside ``chunk_fn``
    are issued the same number of times on every rank.

    Args:
        chunk_fn: ``(chunk, x_CD, top_k_index_CK, top_k_weights_CK) -> out_CD`` with ``chunk``
            the chunk's index in [0, c); pure in its tensor inputs and the parameters it closes
            over (it is re-run in backward when recomputing).
        x_TD: (T, d) float layer input.
        top_k_index: (T, k) int64 expert ids from the router (sentinels ≥ E allowed).
        top_k_weights: (T, k) routing weights (differentiable: the router gets its gradient
            through them).
        num_chunks: c ≥ 1; c > T is allowed (the trailing chunks are then empty).
        recompute: ``none`` runs the chunks plainly; ``experts`` and ``full`` checkpoint each chunk.

    Returns:
        (T, d) output, ``torch.cat`` of the chunk outputs. Empty chunks run too, so parameters
        get (zero) gradients with T = 0.

    Raises:
        ValueError: on an unknown recompute mode, c < 1, or (T, k) shapes that do not match x.

    Memory: per chunk, with ``experts``/``full`` nothing but the chunk's inputs (views of the
    layer's x_TD, top_k_index, top_k_weights) is kept for backward; with ``none`` whatever
    ``chunk_fn`` saves. The split of x and the weights is one ``split_with_sizes`` node, so its
    backward concatenates the chunk gradients once (T·d, not c × T·d zero-filled slices).
    Side effects: none (routing counters and losses belong to the caller, outside recompute).

    Reference: MemFine §4 (per-chunk recompute; router outside the chunk loop).
    """
    _check_chunk_inputs(x_TD, top_k_index, top_k_weights, recompute)
    sizes = chunk_sizes(x_TD.shape[0], num_chunks)
    if num_chunks == 1:  # one piece: the layer's own tensors, no split node
        pieces = [(x_TD, top_k_index, top_k_weights)]
    else:
        pieces = list(zip(torch.split(x_TD, sizes), torch.split(top_k_index, sizes),
                          torch.split(top_k_weights, sizes), strict=True))
    outs = []
    for i, (x_CD, index_CK, weights_CK) in enumerate(pieces):
        if recompute == "none" or not torch.is_grad_enabled():  # no backward: nothing to drop
            outs.append(chunk_fn(i, x_CD, index_CK, weights_CK))
        else:
            # NOTE(memory): only the chunk inputs (views of the layer's tensors) are kept; H
            # (S_c·G·D_t bytes) and the index arrays are rebuilt in backward, one chunk at a time.
            outs.append(checkpoint(chunk_fn, i, x_CD, index_CK, weights_CK, use_reentrant=False,
                                   preserve_rng_state=False))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
