"""memfine inside torchtitan's MoE models: parity with torchtitan's own MoE, state dicts, config
converter, dispatch modes, saved-for-backward bytes.

References: (1) float64: torchtitan's router and shared experts in float64 with the routed part
computed by memfine.reference's per-token loop on torchtitan's weights (fp32 tolerance);
(2) torchtitan's own MoE, unchanged; its GroupedExperts casts to bf16 for the grouped GEMMs, so
this comparison uses the bf16 tolerance, also for fp32 parameters. Gradients are compared after
dividing both sides by the reference's largest magnitude (a tolerance relative to the tensor).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed "
                    "(pip install -c constraints.txt 'memfine[torchtitan]')")

from torchtitan_models import (  # noqa: E402
    build_model,
    build_moe,
    forward_tokens,
    model_config,
    routed_saved_bytes,
)

from memfine.integrations import torchtitan as mf_tt  # noqa: E402
from memfine.reference import reference_experts  # noqa: E402
from tolerances import LOSS_ATOL, assert_close  # noqa: E402

FUSED_MODELS = ("qwen3", "deepseek_v3", "deepseek_v3_sigmoid_scaled")
CHUNKS = [pytest.param({}, id="c1"), pytest.param({"num_chunks": 3}, id="c3"),
          pytest.param({"memory_budget": "budget"}, id="budget")]
# Budgets of the default tiny block (T = 24, k = 2, d 32, n 16) and the c MACT picks: in fp32
# 2 chunks fit; in bf16 the exact model has c = 1 lowest (at this size the chunks' weight-gradient
# buffers cost more than they save), so the budget runs c = 1 with recompute.
BUDGETS = {torch.float32: ("55KiB", 2), torch.bfloat16: ("37KiB", 1)}


def _convert(moe: torch.nn.Module, chunk: dict, dtype: torch.dtype) -> torch.nn.Module:
    """A converted copy of ``moe``; the budget marker becomes the dtype's budget."""
    converted = copy.deepcopy(moe)
    if chunk.get("memory_budget") == "budget":
        chunk = {"memory_budget": BUDGETS[dtype][0]}
    assert mf_tt.convert_model(converted, **chunk) == ["routed_experts"]
    return converted


def _assert_mact_chose(converted: torch.nn.Module, chunk: dict, dtype: torch.dtype) -> None:
    """MACT chose the smallest bin whose exact predicted peak fits, as last_decision."""
    if "memory_budget" in chunk:
        policy = converted.routed_experts._memfine_gate._memfine_chunk_policy
        dt = torch.finfo(dtype).bits // 8
        budget = policy.config.memory_budget_bytes
        want = next(c for c in policy.config.bins if policy.layer_peak(24, dt, c) <= budget)
        assert want == BUDGETS[dtype][1] and policy.num_chunks(48, 24, dt) == want
        decision = converted.routed_experts.last_decision
        assert decision is not None and decision.num_chunks == want


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype,
                        grad: bool, msg: str) -> None:
    scale = float(expected.detach().abs().max().clamp(min=torch.finfo(torch.float32).tiny))
    assert_close(actual.detach().double() / scale, expected.detach().double() / scale,
                 grad=grad, dtype=dtype, msg=msg)


def _inputs(moe: torch.nn.Module, B: int = 2, L: int = 12, seed: int = 1):
    torch.manual_seed(seed)
    dtype = next(moe.parameters()).dtype
    D = moe.router.gate.weight.shape[1]
    return torch.randn(B, L, D, dtype=dtype, requires_grad=True), torch.randn(B, L, D)


def _run(moe: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Output and the gradients of x and of every parameter (by name) for incoming grad g."""
    x = x.detach().clone().requires_grad_()
    out = moe(x)
    names, params = zip(*moe.named_parameters(), strict=True)
    grads = torch.autograd.grad(out, (x, *params), g.to(out.dtype), allow_unused=True)
    return out, dict(zip(("x", *names), grads, strict=True))


def _reference64(moe: torch.nn.Module, x: torch.Tensor, g: torch.Tensor):
    """torchtitan's router and shared experts in float64, routed part by the per-token loop."""
    moe64 = copy.deepcopy(moe).double()

    class Reference(torch.nn.Module):
        def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
            B, L, D = x_BLD.shape
            scores, ids, _ = moe64.router(x_BLD, moe64.expert_bias_E)
            inner = moe64.routed_experts.inner_experts
            w_up = torch.cat([inner.w1_EFD.transpose(1, 2), inner.w3_EFD.transpose(1, 2)], 2)
            routed = reference_experts(x_BLD.reshape(B * L, D), ids.reshape(B * L, -1),
                                       scores.reshape(B * L, -1), w_up,
                                       inner.w2_EDF.transpose(1, 2)).view(B, L, D)
            shared = moe64.shared_experts
            return routed if shared is None else routed + shared(x_BLD)

    reference = Reference()
    reference.moe64 = moe64  # parameter names as torchtitan's, prefixed by "moe64."
    out, grads = _run(reference, x.double(), g.double())
    return out, {k.removeprefix("moe64."): v for k, v in grads.items()}


def _compare(got, want, *, dtype: torch.dtype, label: str) -> None:
    out, grads = got
    ref_out, ref_grads = want
    assert_scaled_close(out, ref_out, dtype=dtype, grad=False, msg=f"{label} output")
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert grads[name] is not None, f"{label}: no gradient for {name}"
        assert_scaled_close(grads[name], ref_grad, dtype=dtype, grad=True, msg=f"{label} {name}")


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("model", FUSED_MODELS)
def test_fp32_matches_float64_reference(model: str, chunk: dict) -> None:
    moe = build_moe(model)
    x, g = _inputs(moe)
    converted = _convert(moe, chunk, torch.float32)
    _compare(_run(converted, x, g), _reference64(moe, x, g), dtype=torch.float32, label=model)
    _assert_mact_chose(converted, chunk, torch.float32)


@pytest.mark.parametrize("chunk", CHUNKS[:2])
def test_plain_impl_matches_float64_reference(chunk: dict) -> None:
    moe = build_moe("deepseek_v3")
    x, g = _inputs(moe)
    converted = copy.deepcopy(moe)
    mf_tt.convert_model(converted, impl="plain", **chunk)
    _compare(_run(converted, x, g), _reference64(moe, x, g), dtype=torch.float32, label="plain")


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", FUSED_MODELS)
def test_matches_torchtitans_own_moe(model: str, dtype: torch.dtype, chunk: dict) -> None:
    moe = build_moe(model, dtype=dtype)
    x, g = _inputs(moe)
    converted = _convert(moe, chunk, dtype)
    _compare(_run(converted, x, g), _run(moe, x, g), dtype=torch.bfloat16, label=model)
    _assert_mact_chose(converted, chunk, dtype)


@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize("chunk", CHUNKS[:2])
def test_gpt_oss_matches_torchtitan_bf16(chunk: dict, impl: str) -> None:
    # torchtitan's GPT-OSS experts return bf16 rows, which its combine cannot scatter into fp32
    # tokens on CPU ("scatter(): Expected self.dtype to be equal to src.dtype"): bf16 only.
    # fused: GatedActivation.gpt_oss + biases; plain: torchtitan's own swiglu on the rows.
    moe = build_moe("gpt_oss", dtype=torch.bfloat16)
    x, g = _inputs(moe)
    converted = copy.deepcopy(moe)
    mf_tt.convert_model(converted, impl=impl, **chunk)
    _compare(_run(converted, x, g), _run(moe, x, g), dtype=torch.bfloat16, label="gpt_oss")


def test_torchtitan_dispatch_equals_memfine_dispatch_and_unused_experts_get_zeros() -> None:
    moe = build_moe("deepseek_v3", num_experts=8)
    x, g = _inputs(moe)
    with torch.no_grad():  # experts 6 and 7 never chosen
        moe.expert_bias_E[6:] = -1e4 if moe.expert_bias_E is not None else 0
    runs = {}
    for dispatch in ("memfine", "torchtitan"):
        converted = copy.deepcopy(moe)
        mf_tt.convert_model(converted, dispatch=dispatch, num_chunks=2)
        runs[dispatch] = _run(converted, x, g)
    _compare(runs["torchtitan"], runs["memfine"], dtype=torch.float32, label="dispatch")
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        grad = runs["memfine"][1][f"routed_experts.inner_experts.{name}"]
        assert torch.equal(grad[6:], torch.zeros_like(grad[6:])), name
        assert grad[:6].abs().sum() > 0, name


@pytest.mark.parametrize("model", ["qwen3", "deepseek_v3_sigmoid_scaled"])
def test_model_loss_and_every_gradient(model: str) -> None:
    reference = build_model(model_config(model, n_layers=2))
    converted = copy.deepcopy(reference)
    assert len(mf_tt.convert_model(converted, num_chunks=3)) == 2
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for net in (reference, converted):
        logits = forward_tokens(net, tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
        grads.append({name: p.grad for name, p in net.named_parameters()})
    assert_close(losses[1], losses[0], dtype=torch.bfloat16, msg="loss")
    assert grads[0].keys() == grads[1].keys()
    for name, ref_grad in grads[0].items():
        assert_scaled_close(grads[1][name], ref_grad, dtype=torch.bfloat16, grad=True, msg=name)


def test_state_dict_and_hf_adapter_unchanged() -> None:
    from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter

    config = model_config("deepseek_v3", n_layers=2)
    reference = build_model(config)
    converted = copy.deepcopy(reference)
    mf_tt.convert_model(converted)
    ref_sd, got_sd = reference.state_dict(), converted.state_dict()
    assert list(ref_sd) == list(got_sd)
    assert all(torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd)
    adapter = DeepSeekV3StateDictAdapter(config, None)
    ref_hf, got_hf = adapter.to_hf(ref_sd), adapter.to_hf(got_sd)
    assert list(ref_hf) == list(got_hf)
    assert all(torch.equal(ref_hf[k], got_hf[k]) for k in ref_hf)
    reloaded = copy.deepcopy(converted)
    reloaded.load_state_dict(adapter.from_hf(got_hf))
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in got_sd.items())


def test_config_converter_builds_the_converted_model() -> None:
    from torchtitan.models.common.moe import RoutedExperts

    config = model_config("qwen3", n_layers=2)
    converted_config = mf_tt.converter(num_chunks=2).build().convert(copy.deepcopy(config))
    built = build_model(converted_config)
    in_place = build_model(config)
    mf_tt.convert_model(in_place, num_chunks=2)
    kinds = {type(m).__name__ for m in built.modules() if isinstance(m, RoutedExperts)}
    assert kinds == {"MemfineRoutedExperts"}
    assert list(built.state_dict()) == list(in_place.state_dict())
    tokens = torch.randint(0, 64, (2, 8))
    assert torch.equal(forward_tokens(built, tokens), forward_tokens(in_place, tokens))
    with pytest.raises(ValueError, match="no RoutedExperts.Config"):
        mf_tt.converter().build().convert(converted_config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_at_the_x_plus_h_floor(dtype: torch.dtype) -> None:
    moe = build_moe("qwen3", dtype=dtype, dim=256, hidden=256, num_experts=8, top_k=2)
    x, _ = _inputs(moe, B=2, L=32)
    T, D = 64, 256
    floor = (T * D + 2 * T * 2 * 256) * x.element_size()  # x + H (T·d + 2·T·k·n elements)
    torchtitan_bytes = routed_saved_bytes(moe, x)
    converted = copy.deepcopy(moe)
    mf_tt.convert_model(converted)
    memfine_bytes = routed_saved_bytes(converted, x)
    chunked = copy.deepcopy(moe)
    mf_tt.convert_model(chunked, num_chunks=4)
    chunked_bytes = routed_saved_bytes(chunked, x)
    assert floor <= memfine_bytes <= 1.02 * floor, (memfine_bytes, floor)
    assert torchtitan_bytes > 1.5 * floor, (torchtitan_bytes, floor)
    # with recompute only x and the routing (int64 ids, scores) survive forward
    assert chunked_bytes <= T * D * x.element_size() + T * 2 * (8 + 4) + 64, chunked_bytes


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="TorchtitanExpertsConfig.dispatch"):
        mf_tt.TorchtitanExpertsConfig(dispatch="deepep")
    with pytest.raises(ValueError, match="has no torchtitan RoutedExperts"):
        mf_tt.convert_model(torch.nn.Linear(2, 2))
    moe = build_moe("qwen3")
    mf_tt.convert_model(moe, dispatch="memfine")
    moe.routed_experts.token_dispatcher.ep_mesh = object()  # as if wired for EP
    x, _ = _inputs(moe)
    with pytest.raises(ValueError, match="dispatch='memfine' replaces torchtitan's local"):
        moe(x)
    with pytest.raises(ValueError, match=r"already converted: \['routed_experts'\]"):
        mf_tt.convert_model(moe)


def _train_losses(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps on the same batch (next-token cross-entropy)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        logits = forward_tokens(model, tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_steps_converter_on_and_off() -> None:
    # torchtitan's Trainer cannot run on a CPU-only torch (docs/torchtitan.md), so this trains the
    # model directly: converter off (torchtitan's bf16 grouped GEMMs) vs on (fp32, c = 1 and 3).
    config = model_config("deepseek_v3_sigmoid_scaled", n_layers=2)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, options in (("off", None), ("c1", {}), ("c3", {"num_chunks": 3})):
        model = build_model(config)
        if options is not None:
            mf_tt.convert_model(model, **options)
        runs[name] = torch.tensor(_train_losses(model, tokens, steps=4))
    assert runs["off"][-1] < runs["off"][0]  # the steps learn
    assert_close(runs["c1"], runs["off"], dtype=torch.bfloat16, msg="memfine vs torchtitan")
    torch.testing.assert_close(runs["c3"], runs["c1"], atol=LOSS_ATOL, rtol=0)
