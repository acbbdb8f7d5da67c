"""Allocation timeline of the router node: router and aux losses, forward and backward.

:class:`memfine.router_node.RouterNode` runs the router and the losses without a graph in
forward (every tensor but its outputs freed as its last reference goes) and, in its backward,
runs them again with a graph from x and the router weight (the forward's selection and drops
replayed, no selection) and differentiates them with ``torch.autograd.grad``: the losses'
backward first (their nodes are the newest), then the weights' chain, the scores', the
matmul's. The gradients the node receives (the experts' weight gradient) and the recompute's
outputs stay referenced until the node returns.

Legend: T tokens, K = k, E experts, D = d, D_t activation bytes, R router bytes.
Reference: our derivation from the code and torch.profiler's allocator events
(tests/memory/test_layer.py, every router kind); docs/design.md §2, §5.
"""

from __future__ import annotations

from memfine.timeline.base import Shape, Timeline, engine_sum
from memfine.timeline.capacity import capacity_forward
from memfine.timeline.lora import router_trained
from memfine.timeline.scores import SCORE_TIMELINES, Sizes


def _selection(tl: Timeline, s: Shape, sz: Sizes) -> str:
    """where(bias.any(), scores + bias, logits), then the top-k (routing.groups).

    fp32 (R = 4) on the CPU: the keyed top-k (a scratch copy, its NaN mask, the sign mask, the
    int64 keys, two (E,) index vectors, then topk's values and indices); float64 or another
    device: a stable sort and a (T, k) copy.
    """
    biased = tl.alloc("router.biased_scores", sz.te)
    flag = tl.alloc("router.bias_any", 1)
    select = tl.alloc("router.selection", sz.te)
    tl.free(flag)
    tl.free(biased)
    if sz.r == 4 and s.device_type == "cpu":
        index = _keyed_top_k(tl, sz)
    else:
        values = tl.alloc("router.sort_values", sz.te)
        order = tl.alloc("router.sort_order", sz.T * sz.E * 8)
        tl.free(tl.alloc("router.sort_arange", sz.E * 8), values)  # the sort's (E,) int64 ids
        index = order
        if sz.K < sz.E:  # else [:, :E].contiguous() is the sort order itself
            index = tl.alloc("router.top_k_index", sz.T * sz.K * 8)
            tl.free(order)
    tl.free(select)
    return index


def _keyed_top_k(tl: Timeline, sz: Sizes) -> str:
    """routing.groups.top_k_lowest_index on fp32 scores: (T, k) int64 indices."""
    cells = sz.T * sz.E
    zero = tl.alloc("router.key_zero", 8)  # the wrapped Python 0.0 of ``+ 0.0``
    value = tl.alloc("router.key_value", cells * 4)
    tl.free(zero)
    tl.free(tl.alloc("router.key_nan_mask", cells))
    tl.free(tl.alloc("router.key_sign", cells * 4))
    keys = tl.alloc("router.keys", cells * 8)
    tl.free(value)
    column = tl.alloc("router.key_arange", sz.E * 8)
    low = tl.alloc("router.key_low", sz.E * 8)
    tl.free(column)
    tl.free(low)
    top_values = tl.alloc("router.top_k_keys", sz.T * sz.K * 8)
    index = tl.alloc("router.top_k_index", sz.T * sz.K * 8)
    tl.free(keys, top_values)
    return index


def router_forward(tl: Timeline, s: Shape, *, graph: bool) -> dict[str, str]:
    """Logits, scores, selection (forward) or replay (``graph``: backward's recompute), weights.

    Returns the names alive after :func:`memfine.routing.route` returns: ``logits``,
    ``scores``, ``weights`` (the output, in D_t), ``counts``, ``index`` (forward) or
    ``masked_index`` (capacity), ``dropped`` (forward with capacity) and what the graph keeps.
    """
    T, E, D, K, r = s.T, s.moe.num_experts, s.moe.hidden_size, s.moe.top_k, s.r
    rt: dict[str, str] = {}
    if s.cast:  # x.to(fp32), W.to(fp32): the matmul keeps each for the other's gradient
        rt["x32"] = tl.alloc("router.x_fp32", T * D * r)
        rt["w32"] = tl.alloc("router.w_fp32", E * D * r)
    rt["logits"] = tl.alloc("router.logits", T * E * r)
    if s.cast and not graph:
        tl.free(rt.pop("w32"), rt.pop("x32"))
    elif s.cast and not router_trained(s):  # a frozen weight: x's copy is not kept
        tl.free(rt.pop("x32"))
    sz, st = Sizes(T, K, E, r), SCORE_TIMELINES[s.moe.score_func]
    rt["scores"] = st.scores(tl, sz)
    if not graph:
        rt["index"] = _selection(tl, s, sz)
    rt["gathered"] = tl.alloc("router.top_k_scores", T * K * r)
    weights = _renormalized(tl, s, rt, sz, graph)
    if s.moe.routed_scaling_factor != 1.0:  # × a wrapped scalar that MulBackward keeps
        rt["scale"] = tl.alloc("router.scale_scalar", 8)
        scaled = tl.alloc("router.scaled_weights", T * K * r)
        if not graph:
            tl.free(rt.pop("scale"))
        weights = _drop_unsaved(tl, rt, weights, scaled, graph)
    if s.moe.capacity_factor is not None:
        if graph:  # the forward's drops: its masked index < E, then both masked copies
            rt["keep"] = tl.alloc("router.replay_keep", T * K)
            rt["masked_index"] = tl.alloc("router.masked_index", T * K * 8)
            masked = tl.alloc("router.masked_weights", T * K * r)
        else:
            masked = capacity_forward(tl, sz, s.moe.drop_policy, rt, weights)
        weights = _drop_unsaved(tl, rt, weights, masked, graph)
    shifted = tl.alloc("router.shifted_ids", T * K * 8)  # count_per_expert
    rt["counts"] = tl.alloc("router.tokens_per_expert", (E + 2) * 8)
    tl.free(shifted)
    if s.cast:
        cast = tl.alloc("router.weights", T * K * s.dt)
        _drop_unsaved(tl, rt, weights, cast, graph)
        weights = cast
    if not graph and "keep" in rt:  # route's local keep mask
        tl.free(rt.pop("keep"))
    rt["weights"] = weights
    return rt


def _drop_unsaved(tl: Timeline, rt: dict[str, str], old: str, new: str, graph: bool) -> str:
    """Free the fp32 weights ``old`` once ``new`` is made from them, unless a node keeps them.

    The ratio's quotient and the plain gathered scores are not saved; the softmax of the log
    scores is (SoftmaxBackward keeps its result), only by a graph.
    """
    if not graph or old != rt.get("soft"):
        tl.free(old)
        for key in [key for key, name in rt.items() if name == old]:
            del rt[key]
    return new


def _renormalized(tl: Timeline, s: Shape, rt: dict[str, str], sz: Sizes, graph: bool) -> str:
    """The k selected weights: the gathered scores, their ratio, or a softmax of log scores.

    The k gathered logits are the renormalisation's argument for every score function.
    """
    if not s.moe.renormalize:
        return rt["gathered"]
    st = SCORE_TIMELINES[s.moe.score_func]
    rt["top_k_logits"] = tl.alloc("router.top_k_logits", sz.tk)
    if st.log_renorm is None:  # s_j / Σ s: DivBackward keeps the gathered scores and the sum
        rt["sum"] = tl.alloc("router.renorm_sum", sz.T * sz.r)
        div = tl.alloc("router.renorm_weights", sz.tk)
        tl.free(*(() if graph else (rt.pop("sum"),)), rt.pop("top_k_logits"),
                *(() if graph else (rt.pop("gathered"),)))
        return div
    before = set(rt)
    logs = st.log_renorm(tl, rt, sz)
    if not graph:  # what their backward would keep goes with its last reference
        tl.free(*(rt.pop(key) for key in set(rt) - before - {"top_k_logits_unsaved"}))
    soft = rt["soft"] = tl.alloc("router.renorm_weights", sz.tk)
    tl.free(logs, rt.pop("gathered"))  # the gathered scores are unused
    if not graph or "top_k_logits_unsaved" in rt:  # else log_sigmoid's backward keeps them
        rt.pop("top_k_logits_unsaved", None)
        tl.free(rt.pop("top_k_logits"))
    return soft


def losses_forward(tl: Timeline, s: Shape, *, graph: bool) -> dict[str, str]:
    """z_loss, then load_balancing_loss, on the logits (forward: after the count statistics)."""
    T, E, K, r = s.T, s.moe.num_experts, s.moe.top_k, s.r
    ls: dict[str, str] = {}
    if not graph:  # loss_counts: the counts and a 1 (held to the node's end)
        one = tl.alloc("aux.one", 8)
        ls["stats"] = tl.alloc("aux.stats", (E + 1) * 8)
        tl.free(one)
    ls["lse"] = tl.alloc("z.logsumexp", T * r)
    square = tl.alloc("z.square", T * r)
    if not graph:
        tl.free(ls.pop("lse"))
    ls["z"] = tl.alloc("aux.z_loss", 4)
    tl.free(square)
    ls["probs"] = tl.alloc("lbl.probs", T * E * r)
    p = tl.alloc("lbl.p", E * r)
    if not graph:
        tl.free(ls.pop("probs"))
    shifted = tl.alloc("lbl.shifted_ids", T * K * 8)  # count_per_expert
    counts = tl.alloc("lbl.counts", (E + 2) * 8)
    tl.free(shifted, tl.alloc("lbl.one", 8))
    cast = tl.alloc("lbl.counts_fp32", E * r)
    tl.free(counts)
    ls["f"] = tl.alloc("lbl.f", E * r)
    tl.free(cast)
    product = tl.alloc("lbl.f_times_p", E * r)
    total = tl.alloc("lbl.sum", 4)
    tl.free(product)
    if graph:  # E · sum: MulBackward keeps the wrapped scalar E
        ls["E"] = tl.alloc("lbl.E_scalar", 8)
    ls["lbl"] = tl.alloc("aux.load_balancing_loss", 4)
    tl.free(total, p, *(() if graph else (ls.pop("f"),)))
    return ls


def node_forward(tl: Timeline, s: Shape) -> dict[str, str]:
    """RouterNode.forward: router and losses without a graph; returns its live outputs.

    Alive after it: ``weights`` (D_t), ``counts``, ``index`` (and ``masked_index``,
    ``dropped`` with capacity), ``lbl`` and ``z``: the (T, E) logits and scores are freed.
    """
    rt = router_forward(tl, s, graph=False)
    ls = losses_forward(tl, s, graph=False)
    tl.free(ls.pop("stats"), rt.pop("logits"), rt.pop("scores"))
    return rt | ls


def router_keeps_logits(s: Shape) -> bool:
    """True when the recompute's graph keeps the (T, E) logits past the z-loss's backward.

    Softplus's backward keeps them, and so does the gather of the k logits that log scores
    renormalise.
    """
    st = SCORE_TIMELINES[s.moe.score_func]
    return st.logits_saved or (s.moe.renormalize and st.log_renorm is not None)


def losses_backward(tl: Timeline, s: Shape, rt: dict[str, str], ls: dict[str, str]) -> str:
    """Backward of load_balancing_loss then z_loss; returns the logits' gradient buffer."""
    T, E, r = s.T, s.moe.num_experts, s.r
    tl.free(ls.pop("E"))  # MulBackward of E · sum
    grad_p = tl.alloc("lbwd.dp", E * r)
    tl.free(ls["f"])
    grad_probs = tl.alloc("lbwd.dprobs", T * E * r)
    tl.free(grad_p)
    grad_logits = tl.alloc("lbwd.dlogits", T * E * r)
    tl.free(grad_probs, ls["probs"])
    grad = tl.alloc("zbwd.mean", T * r)
    p1, p2 = tl.alloc("zbwd.pow", T * r), tl.alloc("zbwd.two_pow", T * r)
    dlse = tl.alloc("zbwd.dlse", T * r)
    tl.free(p2, p1, grad)
    sub, ex = tl.alloc("zbwd.sub", T * E * r), tl.alloc("zbwd.exp", T * E * r)
    grad_z = tl.alloc("zbwd.dlogits", T * E * r)
    tl.free(ex, sub, dlse, *(() if router_keeps_logits(s) else (rt["logits"],)), ls["lse"])
    return engine_sum(tl, grad_logits, grad_z)


def router_backward(tl: Timeline, s: Shape, rt: dict[str, str], grad_weights: str,
                    grad_logits: str) -> str:
    """The recompute's weights chain (renormalisation, gather, scores), then the matmul's.

    ``grad_weights`` (the node's incoming gradient) and the recomputed ``rt["weights"]`` stay
    referenced by the node until it returns. Returns x's gradient (D_t).
    """
    T, E, D, K, r, dt = (s.T, s.moe.num_experts, s.moe.hidden_size, s.moe.top_k, s.r, s.dt)
    held = {grad_weights, rt["weights"]}

    def free(*names: str) -> None:
        tl.free(*(n for n in names if n not in held))

    grad = grad_weights
    if s.cast:  # ToCopyBackward of the final weight cast
        grad = tl.alloc("rbwd.dweights_fp32", T * K * r)
    if "keep" in rt:  # WhereBackward of the masked weights; the mask is freed
        masked = tl.alloc("rbwd.dmasked", T * K * r)
        free(grad, rt.pop("keep"))
        grad = masked
    if "scale" in rt:  # MulBackward: grad × the kept scalar
        scaled = tl.alloc("rbwd.dscaled", T * K * r)
        free(grad, rt["scale"])
        grad = scaled
    sz, st = Sizes(T, K, E, r), SCORE_TIMELINES[s.moe.score_func]
    if s.moe.renormalize and st.log_renorm_backward is not None:
        dsoft = tl.alloc("rbwd.dsoftmax", T * K * r)
        free(grad, rt["soft"])
        grad = st.log_renorm_backward(tl, rt, sz, dsoft)
        scattered = tl.alloc("rbwd.dlogits", T * E * r)  # the gathered logits' gradient
        tl.free(grad, rt["logits"])  # GatherBackward kept the logits; the scores are gone
        acc = engine_sum(tl, grad_logits, scattered)
    else:
        if s.moe.renormalize:
            t1, t2 = tl.alloc("rbwd.div1", T * K * r), tl.alloc("rbwd.div2", T * K * r)
            t3, t4 = tl.alloc("rbwd.neg", T * K * r), tl.alloc("rbwd.mul", T * K * r)
            tl.free(t3, t2, t1)
            d_self, d_sum = tl.alloc("rbwd.dself", T * K * r), tl.alloc("rbwd.dsum", T * r)
            free(t4, grad, rt["sum"], rt["gathered"])
            grad = engine_sum(tl, d_self, d_sum)  # SumBackward's expand of d_sum, in place
        # gather_backward: zeros, then scatter_add_ into them (in place)
        scattered = tl.alloc("rbwd.dscores", T * E * r)
        free(grad)
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
    return grad_x


def node_backward(tl: Timeline, s: Shape, out: dict[str, str], grad_weights: str,
                  grad_x_experts: str) -> None:
    """RouterNode.backward: recompute with a graph, autograd.grad, then x's gradient summed.

    ``out``: :func:`node_forward`'s names (its selection, freed with the node's saved tensors).
    """
    rt = router_forward(tl, s, graph=True)
    ls = losses_forward(tl, s, graph=True)
    # _recompute returns: route's masked index copy and counts go; the outputs stay. Scores
    # that no output uses (renormalised from log scores, no sequence loss) go with them.
    log_renorm = s.moe.renormalize and SCORE_TIMELINES[s.moe.score_func].log_renorm is not None
    tl.free(*(rt.pop(n) for n in ("masked_index", "counts") if n in rt),
            *((rt.pop("scores"),) if log_renorm else ()))
    grad_logits = losses_backward(tl, s, rt, ls)
    grad_x = router_backward(tl, s, rt, grad_weights, grad_logits)
    # the node returns: the outputs, the incoming gradient and the saved selection go
    tl.free(rt["weights"], ls["lbl"], ls["z"], grad_weights,
            *(out.pop(n) for n in ("index", "masked_index") if n in out))
    engine_sum(tl, grad_x_experts, grad_x)  # x's gradient: the experts' one, then the router's
