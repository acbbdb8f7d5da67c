"""Allocation timeline of one MoELayer forward + backward: router, losses and the layer driver.

The expert path (index builders, fused/plain paths, gradient buffers) is in
:mod:`memfine.timeline.experts`; this module adds the fp32 router, the load-balancing and z
losses, and the order in which forward and the autograd engine run them.

Legend: T tokens, K = k, E experts, D = d, D_t activation bytes, R router bytes.
Reference: our derivation from the code (docs/design.md §2, §5).
"""

from __future__ import annotations

from memfine.config import MoEConfig, config_block_rows, shared_block_rows
from memfine.config.lora import LoRAConfig
from memfine.layer_timeline.shared import shared_backward, shared_forward
from memfine.timeline.base import cat_chunks, engine_sum
from memfine.timeline.capacity import capacity_backward, capacity_forward
from memfine.timeline.experts import (
    Shape,
    Timeline,
    WeightGrads,
    chunk_tokens,
    chunks_backward,
    experts_forward,
    plain_backward,
)
from memfine.timeline.fused import fused_backward
from memfine.timeline.lora import LoRAShape, router_trained
from memfine.timeline.scores import SCORE_TIMELINES, Sizes

__all__ = ["Shape", "Timeline", "WeightGrads", "chunk_tokens", "experts_forward",
           "fused_backward", "plain_backward", "simulate_layer"]


def router_forward(tl: Timeline, s: Shape) -> dict[str, str]:
    """TopKRouter.forward + route: logits, scores, top-k, weights, counts."""
    T, E, D, K, r = s.T, s.moe.num_experts, s.moe.hidden_size, s.moe.top_k, s.r
    out: dict[str, str] = {}
    if s.cast:  # x.to(fp32), W.to(fp32): both saved by the matmul
        out["x32"] = tl.alloc("router.x_fp32", T * D * r)
        out["w32"] = tl.alloc("router.w_fp32", E * D * r)
    out["logits"] = tl.alloc("router.logits", T * E * r)
    if s.cast and not router_trained(s):  # a frozen weight: the matmul does not keep x's copy
        tl.free(out.pop("x32"))
    sz, st = Sizes(T, K, E, r), SCORE_TIMELINES[s.moe.score_func]
    out["scores"] = st.scores(tl, sz)
    # selection: where(bias.any(), scores + bias, logits); the bias buffer stays fp32
    biased = tl.alloc("router.biased_scores", T * E * r)
    flag = tl.alloc("router.bias_any", 1)
    select = tl.alloc("router.selection", T * E * r)
    tl.free(flag)
    tl.free(biased)
    # top-k as a stable descending sort (ties → lower expert id), then a (T, k) copy
    values = tl.alloc("router.sort_values", T * E * r)
    order = tl.alloc("router.sort_order", T * E * 8)
    tl.free(values)
    if K < E:
        out["index"] = tl.alloc("router.top_k_index", T * K * 8)
        tl.free(order)
    else:  # [:, :E].contiguous() is the sort order itself
        out["index"] = order
    tl.free(select)
    out["gathered"] = tl.alloc("router.top_k_scores", T * K * r)
    weights = _renormalized(tl, s, out, sz)
    if s.moe.routed_scaling_factor != 1.0:  # × a wrapped scalar that MulBackward keeps
        out["scale"] = tl.alloc("router.scale_scalar", 8)
        scaled = tl.alloc("router.scaled_weights", T * K * r)
        weights = _drop_unsaved(tl, out, weights, scaled)
    if s.moe.capacity_factor is not None:
        masked = capacity_forward(tl, sz, s.moe.drop_policy, out, weights)
        weights = _drop_unsaved(tl, out, weights, masked)
    shifted = tl.alloc("router.shifted_ids", T * K * 8)  # count_per_expert
    out["counts"] = tl.alloc("router.tokens_per_expert", (E + 2) * 8)
    tl.free(shifted)
    if s.cast:
        out["weights"] = tl.alloc("router.weights", T * K * s.dt)
        _drop_unsaved(tl, out, weights, out["weights"])
    else:
        out["weights"] = weights
    return out


def _drop_unsaved(tl: Timeline, rt: dict[str, str], old: str, new: str) -> str:
    """Free the fp32 weights ``old`` once ``new`` is made from them, unless a node keeps them.

    The ratio's quotient and the plain gathered scores are not saved; the softmax of the log
    scores is (SoftmaxBackward keeps its result).
    """
    if old != rt.get("soft"):
        tl.free(old)
        for key in [key for key, name in rt.items() if name == old]:
            del rt[key]
    return new


def _renormalized(tl: Timeline, s: Shape, rt: dict[str, str], sz: Sizes) -> str:
    """The k selected weights: the gathered scores, their ratio, or a softmax of log scores."""
    if not s.moe.renormalize:
        return rt["gathered"]
    st = SCORE_TIMELINES[s.moe.score_func]
    if st.log_renorm is None:  # s_j / Σ s: DivBackward keeps the gathered scores and the sum
        rt["sum"] = tl.alloc("router.renorm_sum", sz.T * sz.r)
        rt["div"] = tl.alloc("router.renorm_weights", sz.tk)
        return rt["div"]
    rt["top_k_logits"] = tl.alloc("router.top_k_logits", sz.tk)  # GatherBackward keeps logits
    logs = st.log_renorm(tl, rt, sz)
    soft = rt["soft"] = tl.alloc("router.renorm_weights", sz.tk)
    tl.free(logs, rt.pop("gathered"))  # the gathered scores are unused
    if "top_k_logits_unsaved" in rt:
        tl.free(rt.pop("top_k_logits_unsaved"))
        del rt["top_k_logits"]
    return soft


def router_keeps_logits(moe: MoEConfig) -> bool:
    """True when a router node keeps the (T, E) logits past the z-loss's backward."""
    st = SCORE_TIMELINES[moe.score_func]
    return st.logits_saved or (moe.renormalize and st.log_renorm is not None)


def losses_forward(tl: Timeline, s: Shape) -> dict[str, str]:
    """load_balancing_loss and z_loss on the router logits."""
    T, E, K, r = s.T, s.moe.num_experts, s.moe.top_k, s.r
    one = tl.alloc("aux.one", 8)  # MoELayer._aux: the counts and a 1 (held to its end)
    stats = tl.alloc("aux.stats", (E + 1) * 8)
    tl.free(one)
    out = {"probs": tl.alloc("lbl.probs", T * E * r)}
    p = tl.alloc("lbl.p", E * r)
    shifted = tl.alloc("lbl.shifted_ids", T * K * 8)  # count_per_expert
    counts = tl.alloc("lbl.counts", (E + 2) * 8)
    tl.free(shifted, tl.alloc("lbl.one", 8))
    cast = tl.alloc("lbl.counts_fp32", E * r)
    tl.free(counts)
    out["f"] = tl.alloc("lbl.f", E * r)
    tl.free(cast)
    product = tl.alloc("lbl.f_times_p", E * r)
    total = tl.alloc("lbl.sum", 4)
    tl.free(product)
    out["lbl"] = tl.alloc("aux.load_balancing_loss", 4)
    tl.free(total, p)
    out["lse"] = tl.alloc("z.logsumexp", T * r)
    square = tl.alloc("z.square", T * r)
    out["z"] = tl.alloc("aux.z_loss", 4)
    tl.free(square, stats)
    return out


def losses_backward(tl: Timeline, s: Shape, rt: dict[str, str], ls: dict[str, str]) -> str:
    """Backward of z_loss then load_balancing_loss; returns the logits' gradient buffer."""
    T, E, r = s.T, s.moe.num_experts, s.r
    grad = tl.alloc("zbwd.mean", T * r)
    p1, p2 = tl.alloc("zbwd.pow", T * r), tl.alloc("zbwd.two_pow", T * r)
    dlse = tl.alloc("zbwd.dlse", T * r)
    tl.free(p2, p1, grad)
    sub, ex = tl.alloc("zbwd.sub", T * E * r), tl.alloc("zbwd.exp", T * E * r)
    grad_logits = tl.alloc("zbwd.dlogits", T * E * r)
    tl.free(ex, sub, dlse, *(() if router_keeps_logits(s.moe) else (rt["logits"],)),
            ls["lse"])
    grad_p = tl.alloc("lbwd.dp", E * r)
    tl.free(ls["f"])
    grad_probs = tl.alloc("lbwd.dprobs", T * E * r)
    tl.free(grad_p)
    grad_soft = tl.alloc("lbwd.dlogits", T * E * r)
    tl.free(grad_probs, ls["probs"])
    return engine_sum(tl, grad_logits, grad_soft)


def router_backward(tl: Timeline, s: Shape, rt: dict[str, str], grad_weights: str,
                    grad_logits: str, grad_x_experts: str) -> None:
    """Backward of the router (renormalisation, gather, scores, matmul) and dx accumulation."""
    T, E, D, K, r, dt = (s.T, s.moe.num_experts, s.moe.hidden_size, s.moe.top_k, s.r, s.dt)
    grad = grad_weights
    if s.cast:  # ToCopyBackward of the final weight cast
        grad = tl.alloc("rbwd.dweights_fp32", T * K * r)
        tl.free(grad_weights)
    if "keep" in rt:
        grad = capacity_backward(tl, Sizes(T, K, E, r), rt, grad)
    if "scale" in rt:  # MulBackward: grad × the kept scalar
        scaled = tl.alloc("rbwd.dscaled", T * K * r)
        tl.free(grad, rt["scale"])
        grad = scaled
    sz, st = Sizes(T, K, E, r), SCORE_TIMELINES[s.moe.score_func]
    if s.moe.renormalize and st.log_renorm_backward is not None:
        dsoft = tl.alloc("rbwd.dsoftmax", T * K * r)
        tl.free(grad, rt["soft"])
        grad = st.log_renorm_backward(tl, rt, sz, dsoft)
        scattered = tl.alloc("rbwd.dlogits", T * E * r)  # the gathered logits' gradient
        tl.free(grad)  # the scores' backward never runs: the scores (and logits it keeps) stay
        if not st.logits_saved:
            tl.free(rt["logits"])
        acc = engine_sum(tl, grad_logits, scattered)
    else:
        if s.moe.renormalize:
            t1, t2 = tl.alloc("rbwd.div1", T * K * r), tl.alloc("rbwd.div2", T * K * r)
            t3, t4 = tl.alloc("rbwd.neg", T * K * r), tl.alloc("rbwd.mul", T * K * r)
            tl.free(t3, t2, t1)
            d_self, d_sum = tl.alloc("rbwd.dself", T * K * r), tl.alloc("rbwd.dsum", T * r)
            tl.free(t4, grad, rt["sum"], rt["gathered"])
            grad = engine_sum(tl, d_self, d_sum)  # SumBackward's expand of d_sum, in place
        # gather_backward: zeros, then scatter_add_ into them (in place)
        scattered = tl.alloc("rbwd.dscores", T * E * r)
        tl.free(grad)  # the top-k index stays: the routing replay's record holds it
        acc = engine_sum(tl, grad_logits, st.scores_backward(tl, rt, sz, scattered))
    trained = router_trained(s)  # a LoRA layer's router is frozen unless trained
    if trained:
        tl.alloc("grad.router_weight_fp32" if s.cast else "grad.router_weight", E * D * r)
    grad_x = tl.alloc("rbwd.dx", T * D * r)
    tl.free(acc)
    if s.cast:
        tl.free(*(rt[n] for n in ("x32", "w32") if n in rt))
        if trained:
            tl.alloc("grad.router_weight", E * D * dt)
            tl.free("grad.router_weight_fp32")
        cast = tl.alloc("rbwd.dx_cast", T * D * dt)
        tl.free(grad_x)
        grad_x = cast
    engine_sum(tl, grad_x_experts, grad_x)  # x's gradient: the experts' one, then the router's


def simulate_layer(moe: MoEConfig, num_tokens: int, dtype_bytes: int, *, num_chunks: int = 1,
                   recompute: str = "none", record: bool = True,
                   keep_aux: bool = True, lora: LoRAConfig | None = None,
                   device_type: str = "cpu", block_rows: int | None = None) -> Timeline:
    """Replay one MoELayer forward + backward (loss gradients given from outside).

    Protocol (what the measurement does): x (T, d) requires grad and exists before; parameters
    have no ``.grad``; the caller keeps out and MoEAux (``keep_aux=False``: only out and the two
    losses); backward runs from out and the two losses with gradients that exist before.
    The timeline marks ``forward`` at the end of forward. ``lora``: the routed experts carry
    split-LoRA adapters on a frozen base (:class:`memfine.nn.lora.LoRAGroupedExperts`), the
    router frozen unless ``lora.train_router`` and the shared experts unless
    ``lora.train_attention`` (:mod:`memfine.timeline.lora`). ``device_type``: the
    activations' device (:class:`memfine.timeline.base.Shape`). ``block_rows``: the routed
    experts' rows per fused row block in the call (None: the config's own,
    :func:`memfine.config.config_block_rows`; the shared experts' follow from it,
    :func:`memfine.config.shared_block_rows`).
    """
    rows = config_block_rows(moe, dtype_bytes, device_type) if block_rows is None else block_rows
    s = Shape(moe, num_tokens, dtype_bytes, device_type, block_rows=rows) if lora is None else \
        LoRAShape(moe, num_tokens, dtype_bytes, device_type, lora=lora, block_rows=rows)
    T, D, K, dt = s.T, moe.hidden_size, moe.top_k, s.dt
    plain, ckpt = moe.experts_impl == "plain", recompute != "none"
    tl = Timeline(record=record)
    rt = router_forward(tl, s)
    sizes = chunk_tokens(T, num_chunks)
    chunk_saved, outs = [], []
    for C in sizes:
        saved, out = experts_forward(tl, s, C, C * K, plain=plain, recompute=ckpt)
        chunk_saved.append(saved)
        outs.append(out)
    out = outs[0]
    if len(outs) > 1:
        out = tl.alloc("fwd.out_cat", T * D * dt)
        tl.free(*outs)
    shared = None
    if moe.num_shared_experts:
        shared, _ = shared_forward(tl, moe, T, dt, sizes, ckpt=ckpt, routed_out=out,
                                   device_type=device_type, block_rows=shared_block_rows(
                                       moe, rows, dtype_bytes, device_type),
                                   frozen=lora is not None and not lora.train_attention)
    ls = losses_forward(tl, s)
    weights_held = ckpt or not plain  # the plain path saves w_TK (a masked copy) instead
    # SoftmaxBackward of the log scores keeps the weights: the router's backward frees them
    weights_held = weights_held and rt["weights"] != rt.get("soft")
    if not weights_held and rt["weights"] != rt.get("soft"):
        tl.free(rt["weights"])
    if not keep_aux:  # the caller drops MoEAux (tokens_per_expert) after forward
        tl.free(rt["counts"])
    tl.mark("forward")
    grad_logits = losses_backward(tl, s, rt, ls)
    tl.mark("losses_backward")
    shared_dx = None if shared is None else shared_backward(tl, moe, shared, ckpt=ckpt)
    grads_w, grads_x = chunks_backward(
        tl, s, sizes, chunk_saved, ckpt=ckpt,
        after_first_chunk=(lambda: tl.free(rt["weights"])) if weights_held else None)
    # SplitWithSizesBackward: one cat per input, and no split (nor cat) with one chunk
    grad_w = cat_chunks(tl, grads_w, "grad.top_k_weights_cat", T * K * dt)
    grad_x = cat_chunks(tl, grads_x, "grad.x_cat", T * D * dt)
    if shared_dx is not None:  # the engine adds the routed experts' dx into the shared ones'
        grad_x = engine_sum(tl, shared_dx, grad_x)
    router_backward(tl, s, rt, grad_w, grad_logits, grad_x)
    tl.mark("end")
    return tl
