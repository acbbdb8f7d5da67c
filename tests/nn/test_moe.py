"""MoELayer against memfine.reference.reference_moe: output, aux losses and every gradient."""

from __future__ import annotations

import pytest
import torch

from memfine.config import MoEConfig
from memfine.nn import MoELayer
from memfine.reference import reference_moe
from memfine.routing import load_balancing_loss, z_loss
from tolerances import assert_close

D, N, E = 8, 8, 4
SHAPE = (2, 5)  # (b, s) tokens, flattened to T = 10 inside the layer


def _layer(dtype: torch.dtype, **overrides: object) -> MoELayer:
    config = MoEConfig(**{"hidden_size": D, "intermediate_size": N, "num_experts": E,
                          "top_k": 2, **overrides})  # type: ignore[arg-type]
    layer = MoELayer(config).to(dtype)
    with torch.no_grad():  # unit-scale router logits and O(1) expert outputs
        layer.router.weight.normal_()
        layer.experts.w_up.normal_(std=D ** -0.5)
        layer.experts.w_down.normal_(std=N ** -0.5)
    return layer


def _params(layer: MoELayer) -> list[torch.Tensor]:
    return [layer.router.weight, layer.experts.w_up, layer.experts.w_down]


def _reference_loss(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor
                    ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """float64 reference: (out, grads of x and the three weights, aux values)."""
    cfg = layer.config
    leaves = [t.detach().double().requires_grad_(True) for t in (x, *_params(layer))]
    x_TD = leaves[0].reshape(-1, D)
    out, idx, logits = reference_moe(x_TD, leaves[1], leaves[2], leaves[3], cfg.top_k,
                                     score_func=cfg.score_func, renormalize=cfg.renormalize,
                                     activation=cfg.activation)
    lbl, z = load_balancing_loss(logits, idx), z_loss(logits)
    loss = (out * grad_out.reshape(-1, D)).sum() + lbl + z
    grads = list(torch.autograd.grad(loss, leaves))
    counts = torch.bincount(idx.flatten(), minlength=E)
    return out.reshape(x.shape), grads, {"lbl": lbl, "z": z, "counts": counts}


CONFIGS = [
    pytest.param({}, id="softmax_renorm"),
    pytest.param({"renormalize": False}, id="softmax_no_renorm"),
    pytest.param({"score_func": "sigmoid"}, id="sigmoid_renorm"),
    pytest.param({"top_k": 1, "renormalize": False}, id="top1"),
    pytest.param({"activation": "geglu"}, id="geglu"),
    pytest.param({"activation": "relu"}, id="relu"),
]


@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_layer_matches_reference(overrides: dict[str, object], dtype: torch.dtype,
                                 impl: str) -> None:
    layer = _layer(dtype, experts_impl=impl, **overrides)
    x = torch.randn(*SHAPE, D, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(*SHAPE, D, dtype=torch.float64)
    out, aux = layer(x)
    ref_out, ref_grads, ref_aux = _reference_loss(layer, x, grad_out)
    assert out.shape == x.shape and out.dtype == dtype and aux.num_chunks == 1
    assert_close(out, ref_out, dtype=dtype, msg="out")
    assert_close(aux.load_balancing_loss, ref_aux["lbl"], dtype=dtype, msg="lbl")
    assert_close(aux.z_loss, ref_aux["z"], dtype=dtype, msg="z")
    assert torch.equal(aux.tokens_per_expert, ref_aux["counts"])
    loss = (out * grad_out.to(dtype)).sum() + aux.load_balancing_loss + aux.z_loss
    grads = torch.autograd.grad(loss, [x, *_params(layer)])
    for name, g, ref_g in zip(("x", "router.weight", "w_up", "w_down"), grads, ref_grads,
                              strict=True):
        assert_close(g, ref_g, grad=True, dtype=dtype, msg=f"grad {name}")


def test_valid_mask_selects_tokens() -> None:
    layer = _layer(torch.float64)
    x = torch.randn(*SHAPE, D, dtype=torch.float64)
    mask = torch.rand(SHAPE) > 0.3
    mask[0, 0], mask[1, 4] = True, False
    x[~mask] = float("nan")  # padding rows are removed by selection, never multiplied by 0
    x.requires_grad_(True)
    out, aux = layer(x, mask)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), D, dtype=torch.float64))
    valid_x = x.detach()[mask].requires_grad_(True)
    grad_out = torch.randn(int(mask.sum()), D, dtype=torch.float64)
    ref_out, ref_grads, ref_aux = _reference_loss(layer, valid_x, grad_out)
    assert_close(out[mask], ref_out)
    assert_close(aux.load_balancing_loss, ref_aux["lbl"])
    assert_close(aux.z_loss, ref_aux["z"])
    assert torch.equal(aux.tokens_per_expert, ref_aux["counts"])
    loss = (out[mask] * grad_out).sum() + aux.load_balancing_loss + aux.z_loss
    grads = torch.autograd.grad(loss, [x, *_params(layer)])
    assert torch.equal(grads[0][~mask], torch.zeros(int((~mask).sum()), D, dtype=torch.float64))
    assert_close(grads[0][mask], ref_grads[0], grad=True)
    for g, ref_g in zip(grads[1:], ref_grads[1:], strict=True):
        assert_close(g, ref_g, grad=True)


@pytest.mark.parametrize("overrides", [{}, {"seq_aux_loss_coef": 0.1, "num_shared_experts": 1}])
def test_integer_attention_mask_equals_bool_mask(overrides: dict[str, object]) -> None:
    """An int64 0/1 mask (a Hugging Face attention_mask) is the bool mask: same output, losses
    and gradients, bit for bit (the bool path is checked against the reference above)."""
    layer = _layer(torch.float64, **overrides)
    mask = torch.rand(SHAPE) > 0.3
    mask[0, 0], mask[1, 4] = True, False
    x = torch.randn(*SHAPE, D, dtype=torch.float64)
    results = []
    for m in (mask, mask.long(), mask.to(torch.int32)):
        xi = x.clone().requires_grad_(True)
        out, aux = layer(xi, m)
        losses = [aux.load_balancing_loss, aux.z_loss]
        if aux.sequence_balance_loss is not None:
            losses.append(aux.sequence_balance_loss)
        loss = (out * out).sum() + sum(losses)
        grads = torch.autograd.grad(loss, [xi, *_params(layer)])
        results.append((out.detach(), [t.detach() for t in losses], aux.tokens_per_expert,
                        grads))
    for out, losses, counts, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(losses, results[0][1], strict=True))
        assert torch.equal(counts, results[0][2])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][3], strict=True))


def test_expert_weight_layout() -> None:
    layer = _layer(torch.float32)
    assert layer.experts.w_up.shape == (E, D, 2 * N)
    assert layer.experts.w_down.shape == (E, N, D)
    assert layer.router.weight.shape == (E, D)
    assert _layer(torch.float32, activation="silu").experts.w_up.shape == (E, D, N)


def test_rejects_bad_inputs() -> None:
    layer = _layer(torch.float32)
    with pytest.raises(ValueError, match=r"^x must be \(\.\.\., d\) with d=8, got \(3, 7\)$"):
        layer(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"^valid_mask must be bool or an integer 0/1 mask "
                                         r"\(nonzero = a real token\), got torch\.float32"):
        layer(torch.zeros(*SHAPE, D), torch.ones(SHAPE))
    with pytest.raises(ValueError, match=r"^valid_mask must have x's token shape \(2, 5\), "
                                         r"got \(5, 2\)$"):
        layer(torch.zeros(*SHAPE, D), torch.ones(5, 2, dtype=torch.bool))


def test_output_is_not_a_view_and_in_place_ops_keep_gradients() -> None:
    """The layer returns its own tensor (not a view of an internal one), so an in-place op on
    it is recorded normally: gradients equal those of the out-of-place op."""
    layer = _layer(torch.float32)
    x = torch.randn(2, 5, D)
    out, _ = layer(x)
    assert out._base is None and out.shape == x.shape
    grads = []
    for in_place in (False, True):
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x)
        out = out.mul_(3.0) if in_place else out * 3.0
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in _params(layer)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
