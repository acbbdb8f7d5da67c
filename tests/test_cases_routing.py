"""Routing, loss and expert cases from known MoE failures; each pytest id is the case id.

Capacity, token-dropping and group-limited cases are in ``tests/test_cases_capacity.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from memfine.config import ChunkConfig, MoEConfig
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.nn import MoELayer
from memfine.ops import combine_rows
from memfine.reference import reference_experts, reference_moe
from memfine.routing import TopKRouter, load_balancing_loss, route, z_loss
from tolerances import CHUNKED_ATOL, assert_close

BACKENDS = ["loop", "grouped_mm", "auto"] if hasattr(torch, "_grouped_mm") else ["loop"]
IMPLS = ["fused", "plain"]


def _round_robin(T: int, k: int, E: int) -> torch.Tensor:
    return (torch.arange(T * k) % E).view(T, k)


def _lbl_formula(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """E·Σ_i f_i·P_i in float64, f_i = count_i / (T·k), P_i = mean full softmax."""
    T, k = index.shape
    E = logits.shape[-1]
    f = torch.bincount(index.flatten(), minlength=E).double() / (T * k)
    return E * (f * logits.double().softmax(-1).mean(0)).sum()


def _layer(dtype: torch.dtype = torch.float32, **overrides: object) -> MoELayer:
    config = MoEConfig(**{"hidden_size": 8, "intermediate_size": 8, "num_experts": 4,
                          "top_k": 2, **overrides})  # type: ignore[arg-type]
    layer = MoELayer(config).to(dtype)
    with torch.no_grad():
        layer.router.weight.normal_()
    return layer


def case_lbl_balance() -> None:
    E, k, T = 4, 2, 8
    lbl_a = load_balancing_loss(torch.zeros(T, E), _round_robin(T, k, E))
    assert_close(lbl_a, torch.tensor(1.0))
    values = [float(lbl_a)]
    for scale in (0.5, 1.0, 2.0, 5.0, 10.0):  # routing concentrates on experts {0, 1}
        logits = torch.tensor([scale, scale, 0.0, 0.0]).expand(T, E)
        result = route(logits, k)
        assert sorted(result.top_k_index[0].tolist()) == [0, 1]
        lbl = load_balancing_loss(result.logits, result.top_k_index)
        assert_close(lbl, _lbl_formula(logits, result.top_k_index))
        values.append(float(lbl))
    assert all(a < b for a, b in zip(values, values[1:], strict=False)), values
    assert round(values[-1], 3) == 2.0  # (B): 4·e^10 / (2·e^10 + 2)


def case_lbl_double_softmax() -> None:
    E, k, T = 4, 1, 6
    router = TopKRouter(E, E, k, renormalize=False)
    with torch.no_grad():
        router.weight.copy_(torch.diag(torch.tensor([10.0, 0.0, 0.0, 0.0])))
    x = torch.zeros(T, E)
    x[:, 0] = 1.0  # logits = [10, 0, 0, 0] for every token
    result = router(x)
    assert torch.equal(result.logits, torch.tensor([10.0, 0, 0, 0]).expand(T, E))
    assert not torch.allclose(result.logits.sum(-1), torch.ones(T))  # raw logits, not probs
    assert torch.equal(result.top_k_index, torch.zeros(T, 1, dtype=torch.long))
    lbl = load_balancing_loss(result.logits, result.top_k_index)
    assert_close(lbl, _lbl_formula(result.logits, result.top_k_index))
    assert round(float(lbl.detach()), 4) == 3.9995
    double = load_balancing_loss(result.scores, result.top_k_index)  # softmax applied twice
    assert float(double.detach()) < float(lbl.detach()) / 1.5


def case_lbl_k_invariant() -> None:
    E, T = 8, 16
    for k in (1, 2, 4):
        lbl = load_balancing_loss(torch.zeros(T, E), _round_robin(T, k, E))
        assert_close(lbl, torch.tensor(1.0), msg=f"k={k}")


def case_lbl_counts() -> None:
    E, k = 4, 2
    logits = torch.tensor([[2.0, 1, 0, 0], [2, 0, 1, 0], [2, 0, 0, 1], [2, 1, 0, 0]])
    result = route(logits, k)
    assert [sorted(r) for r in result.top_k_index.tolist()] == [[0, 1], [0, 2], [0, 3], [0, 1]]
    assert result.tokens_per_expert.tolist() == [4, 2, 1, 1]
    index = build_routing_index(result.top_k_index, E)
    assert index.tokens_per_expert().tolist() == [4, 2, 1, 1]
    lbl = load_balancing_loss(result.logits, result.top_k_index)
    f = torch.tensor([4, 2, 1, 1], dtype=torch.float64) / 8
    assert_close(lbl, E * (f * logits.double().softmax(-1).mean(0)).sum())  # full softmax
    round_robin = load_balancing_loss(result.logits, _round_robin(4, k, E))
    assert float(lbl) > float(round_robin)


def case_sigmoid_tiny() -> None:
    result = route(torch.full((4, 8), -60.0), 2, score_func="sigmoid", renormalize=True)
    assert bool(torch.isfinite(result.top_k_weights).all())
    assert_close(result.top_k_weights.sum(-1), torch.ones(4))
    assert_close(result.top_k_weights, torch.full((4, 2), 0.5))


def case_router_fp32() -> None:
    probs = torch.tensor([0.3010, 0.3005, 0.2506, 0.1479])
    assert probs[0].bfloat16() == probs[1].bfloat16()  # the premise of the case
    router = TopKRouter(4, 4, 2)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = probs.log()
    x = torch.zeros(4, 4, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    result = router(x)
    expected_logits = probs.log().expand(4, 4)
    assert torch.equal(result.logits, expected_logits)
    assert result.top_k_index.tolist() == [[0, 1]] * 4  # top-1 is expert 0, as in fp32
    top = expected_logits.softmax(-1).topk(2, dim=-1).values
    expected = top / top.sum(-1, keepdim=True)
    assert result.top_k_weights.dtype == torch.bfloat16
    assert torch.equal(result.top_k_weights, expected.bfloat16())


def case_topk1_norm() -> None:
    result = route(torch.randn(5, 4), 1, renormalize=True)
    assert result.top_k_weights.shape == (5, 1)
    assert torch.equal(result.top_k_weights, torch.ones(5, 1))


def case_topk1_router_grad() -> None:
    with pytest.raises(ValueError, match=r"^MoEConfig\.renormalize must be False when top_k=1 "
                                         r"\(renormalised top-1 weights are all 1\.0"):
        _layer(top_k=1, renormalize=True)
    layer = _layer(torch.float64, top_k=1, renormalize=False, aux_loss_coef=0.0)
    x = torch.randn(8, 8, dtype=torch.float64)
    out, _ = layer(x)
    out.sum().backward()
    grad = layer.router.weight.grad
    assert grad is not None and bool(grad.abs().sum() > 0)
    w_router = layer.router.weight.detach().clone().requires_grad_(True)
    ref, _, _ = reference_moe(x, w_router, layer.experts.w_up.detach(),
                              layer.experts.w_down.detach(), 1, renormalize=False)
    ref.sum().backward()
    assert_close(grad, w_router.grad, grad=True)


def case_z_loss() -> None:
    z_a = z_loss(torch.zeros(4, 8))
    assert_close(z_a, torch.tensor(math.log(8) ** 2))
    assert round(float(z_a), 4) == 4.3241
    logits_b = torch.zeros(4, 8)
    logits_b[:, 0] = 100.0
    z_b = z_loss(logits_b)
    assert z_b.dtype == torch.float32
    assert_close(z_b, torch.tensor(10000.0))
    z_c = z_loss(torch.full((4, 8), 12.0, dtype=torch.float16))
    assert z_c.dtype == torch.float32 and bool(torch.isfinite(z_c))
    assert_close(z_c, torch.tensor((12 + math.log(8)) ** 2))


def case_empty_expert_grads() -> None:
    E, d, n = 5, 8, 16
    for dtype in (torch.float32, torch.bfloat16):
        w_up = (torch.randn(E, d, 2 * n) / d ** 0.5).to(dtype).requires_grad_(True)
        w_down = (torch.randn(E, n, d) / n ** 0.5).to(dtype).requires_grad_(True)
        for sizes in ([3, 0, 5, 2, 0], [0, 0, 0, 0, 0]):
            index_T1 = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))[:, None]
            T = index_T1.shape[0]
            x = torch.randn(T, d).to(dtype)
            weights = torch.rand(T, 1).to(dtype)
            ref_w = [w.detach().double().requires_grad_(True) for w in (w_up, w_down)]
            ref = reference_experts(x.double(), index_T1, weights.double(), *ref_w)
            grad_out = torch.randn(T, d)
            ref.backward(grad_out.double())
            for impl in IMPLS:
                for backend in BACKENDS:
                    where = f"{dtype} {sizes} {impl} {backend}"
                    _stale_buffer_pass(w_up, w_down, impl, backend)
                    index = build_routing_index(index_T1, E)
                    out = run_experts(x, weights, index, w_up, w_down,
                                      impl=impl, backend=backend)  # type: ignore[arg-type]
                    out.backward(grad_out.to(dtype))
                    for w, rw in zip((w_up, w_down), ref_w, strict=True):
                        assert w.grad is not None, where
                        assert bool(torch.isfinite(w.grad).all()), where
                        for e in range(E):
                            if sizes[e] == 0:
                                assert not w.grad[e].any(), f"{where}: expert {e}"
                        assert_close(w.grad, rw.grad, grad=True, msg=where)
                        w.grad = None


def _stale_buffer_pass(w_up: torch.Tensor, w_down: torch.Tensor, impl: str,
                       backend: str) -> None:
    """A pass in which every expert gets rows, so stale buffer contents would show later."""
    E, d = w_up.shape[:2]
    index = build_routing_index(torch.arange(2 * E).view(-1, 1) % E, E)
    x = torch.randn(2 * E, d).to(w_up.dtype)
    out = run_experts(x, torch.ones(2 * E, 1, dtype=w_up.dtype), index, w_up, w_down,
                      impl=impl, backend=backend)  # type: ignore[arg-type]
    out.pow(2).sum().backward()
    w_up.grad = w_down.grad = None


def case_nan_padding() -> None:
    T, k, d = 8, 2, 4
    pad = torch.arange(T) >= T // 2  # 4 padding tokens = 8 of the 16 routed slots
    x = torch.randn(T, d, dtype=torch.float64)
    x[pad] = float("nan")
    # Through the layer's valid_mask.
    layer = _layer(torch.float64, hidden_size=d)
    xl = x.clone().requires_grad_(True)
    out, aux = layer(xl, ~pad)
    (out.sum() + aux.load_balancing_loss + aux.z_loss).backward()
    assert torch.equal(out[pad], torch.zeros(T // 2, d, dtype=torch.float64))
    for t in (out, xl.grad, *(p.grad for p in layer.parameters())):
        assert t is not None and bool(torch.isfinite(t).all())
    ref, _, _ = reference_moe(x[~pad], layer.router.weight.detach(),
                              layer.experts.w_up.detach(), layer.experts.w_down.detach(), k)
    assert_close(out[~pad], ref)
    # At the ops level: sentinel ids and weight 0.
    top_k_index = torch.where(pad[:, None], 4, torch.rand(T, 4).argsort(-1)[:, :k])
    weights = torch.where(pad[:, None], 0.0, torch.rand(T, k, dtype=torch.float64))
    masters = (x, weights, layer.experts.w_up.detach(), layer.experts.w_down.detach())
    ref = reference_experts(x, top_k_index, *masters[1:])
    for impl in IMPLS:
        for backend in BACKENDS:
            for dtype in (torch.float32, torch.float64):
                if dtype == torch.float64 and backend == "grouped_mm":
                    continue
                leaves = [t.detach().to(dtype).requires_grad_(True) for t in masters]
                index = build_routing_index(top_k_index, 4)
                out = run_experts(leaves[0], leaves[1], index, leaves[2], leaves[3],
                                  impl=impl, backend=backend)  # type: ignore[arg-type]
                out.sum().backward()
                assert torch.equal(out[pad], torch.zeros(T // 2, d, dtype=dtype))
                for t in (out, *(leaf.grad for leaf in leaves)):
                    assert t is not None and bool(torch.isfinite(t).all()), (impl, backend)
                assert_close(out[~pad], ref[~pad], dtype=dtype)


def case_empty_batch() -> None:
    for impl in IMPLS:
        layer = _layer(experts_impl=impl)
        x = torch.zeros(0, 8, requires_grad=True)
        out, aux = layer(x)
        assert out.shape == (0, 8)
        (out.sum() + aux.load_balancing_loss + aux.z_loss).backward()
        assert x.grad is not None and x.grad.shape == (0, 8)
        for name, p in layer.named_parameters():
            assert p.grad is not None, name
            assert torch.equal(p.grad, torch.zeros_like(p)), name
        assert torch.equal(aux.tokens_per_expert, torch.zeros(4, dtype=torch.long))


def _run_once(layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(True)
    out, aux = layer(xr)
    ((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
     + aux.load_balancing_loss + aux.z_loss).backward()
    return [out.detach(), xr.grad, *(p.grad for p in layer.parameters())]  # type: ignore[list-item]


def case_determinism() -> None:
    T, k, E, d = 16, 4, 8, 32
    x = torch.randn(T, d)
    for impl in IMPLS:
        layer = _layer(hidden_size=d, intermediate_size=d, num_experts=E, top_k=k,
                       experts_impl=impl)
        for deterministic in (False, True):
            previous = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic)
            try:
                first = _run_once(layer, x)
                for _ in range(9):
                    for a, b in zip(first, _run_once(layer, x), strict=True):
                        assert torch.equal(a, b), (impl, deterministic)
            finally:
                torch.use_deterministic_algorithms(previous)
    # The combine is the per-token sum of the weighted rows, in slot order.
    result = route(torch.randn(T, E), k)
    index = build_routing_index(result.top_k_index, E)
    y_SD = torch.randn(index.num_rows, d)
    rows = y_SD[index.token_index_map.long().flatten()].view(T, k, d)
    expected = (result.top_k_weights[..., None] * rows).reshape(T, k, d).sum(1)
    assert torch.equal(combine_rows(y_SD, result.top_k_weights, index.token_index_map), expected)


def case_aux_grad_path() -> None:
    """Router gradient when only one of the main and the aux loss reaches it, chunked or not."""
    T, E, k, d, coef = 8, 4, 2, 8, 0.01
    x = torch.randn(T, d, dtype=torch.float64)
    probe = torch.randn(T, d, dtype=torch.float64)
    for chunk in (ChunkConfig(num_chunks=1, recompute="none"),
                  ChunkConfig(num_chunks=4, recompute="experts")):
        config = MoEConfig(hidden_size=d, intermediate_size=d, num_experts=E, top_k=k,
                           aux_loss_coef=coef)
        layer = MoELayer(config, chunk=chunk).double()
        with torch.no_grad():
            layer.router.weight.normal_()
        w_r = layer.router.weight.detach().clone().requires_grad_(True)
        ref_out, ref_idx, ref_logits = reference_moe(
            x, w_r, layer.experts.w_up.detach(), layer.experts.w_down.detach(), k)
        ref_main, ref_aux = (ref_out * probe).sum(), _lbl_formula(ref_logits, ref_idx)
        for name, main_scale, aux_coef in (("main-detached", 0.0, coef), ("aux-zero", 1.0, 0.0)):
            layer.zero_grad(set_to_none=True)
            out, aux = layer(x)
            main = (out * probe).sum()
            main = main if main_scale else main.detach()
            (main + aux_coef * aux.load_balancing_loss).backward()
            ref_loss = (ref_main if main_scale else ref_main.detach()) + aux_coef * ref_aux
            (want,) = torch.autograd.grad(ref_loss, w_r, retain_graph=True)
            got = layer.router.weight.grad
            assert got is not None and bool(got.abs().sum() > 0), (name, chunk)
            assert bool(want.abs().sum() > 0), (name, chunk)
            torch.testing.assert_close(got, want, atol=CHUNKED_ATOL, rtol=0,
                                       msg=lambda m, n=name, c=chunk: f"{n} {c}: {m}")


CASES: list[tuple[str, Callable[[], None]]] = [
    ("lbl-balance", case_lbl_balance),
    ("lbl-double-softmax", case_lbl_double_softmax),
    ("lbl-k-invariant", case_lbl_k_invariant),
    ("lbl-counts", case_lbl_counts),
    ("sigmoid-tiny", case_sigmoid_tiny),
    ("router-fp32", case_router_fp32),
    ("topk1-norm", case_topk1_norm),
    ("topk1-router-grad", case_topk1_router_grad),
    ("z-loss", case_z_loss),
    ("empty-expert-grads", case_empty_expert_grads),
    ("nan-padding", case_nan_padding),
    ("empty-batch", case_empty_batch),
    ("determinism", case_determinism),
    ("aux-grad-path", case_aux_grad_path),
]


@pytest.mark.parametrize("case", [pytest.param(fn, id=case_id) for case_id, fn in CASES])
def test_case(case: Callable[[], None]) -> None:
    case()
