"""experts_implementation="memfine" against transformers' own "eager" experts.

Every comparison is fp32 and uses the tolerance table: logits and every parameter gradient of
tiny random models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3, GPT-OSS), with and without
token chunks; and, at the experts level, every installed architecture that uses the experts
interface, with sentinel expert ids (ids >= num_experts contribute exactly zero).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'memfine[hf]')")

from hf_models import (  # noqa: E402
    CAUSAL_LMS,
    experts_architectures,
    experts_modules,
    tiny_causal_lm,
    tiny_experts,
)

from memfine.hf import experts as hf_experts  # noqa: E402
from memfine.integrations import transformers as mf_hf  # noqa: E402

CHUNKINGS = {
    "unchunked": {},
    "num_chunks3": {"num_chunks": 3},
    "budget": {},  # a memory budget that needs c = 4 (see _budget_for)
}
BATCH, SEQ = 2, 7
# Architectures whose experts run in the default suite: the six models above plus one of each
# other layout (transposed, non-gated ReLU², post-expert norm, clamped gate, F.silu act_fn,
# tanh-GELU, biases). The other architectures run under -m slow.
FAST_EXPERTS = {*CAUSAL_LMS, "aria", "nemotron_h", "muse_spark", "deepseek_v4", "lfm2_moe",
                "gemma4", "openai_privacy_filter"}


def _experts_params() -> list[object]:
    return [pytest.param(a, id=a, marks=() if a in FAST_EXPERTS else pytest.mark.slow)
            for a in experts_architectures()]


@pytest.fixture(autouse=True)
def _registered():
    mf_hf.register()
    yield
    mf_hf.register()


def _run(model: torch.nn.Module, impl: str, ids: torch.Tensor):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def test_import_does_not_import_transformers() -> None:
    code = ("import sys, memfine, memfine.integrations.transformers; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("chunking", list(CHUNKINGS), ids=list(CHUNKINGS))
@pytest.mark.parametrize("model_type", list(CAUSAL_LMS))
def test_model_matches_eager(model_type: str, chunking: str) -> None:
    if model_type not in transformers.models.__dict__ and not hasattr(
            transformers, CAUSAL_LMS[model_type][1]):
        pytest.skip(f"{model_type} is not in this transformers")
    model = tiny_causal_lm(model_type)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    logits_eager, grads_eager = _run(model, "eager", ids)
    options = CHUNKINGS[chunking]
    if chunking == "budget":
        options = {"memory_budget": _budget_for(experts_modules(model)[0], BATCH * SEQ)}
    mf_hf.register(**options)
    logits, grads = _run(model, "memfine", ids)
    assert all(getattr(m, "_memfine_plan_logged", False) for m in experts_modules(model))
    assert_close(logits, logits_eager, msg=f"{model_type} logits")
    assert grads.keys() == grads_eager.keys()
    for name, grad in grads.items():
        assert_close(grad, grads_eager[name], grad=True, msg=f"{model_type} grad {name}")


def _budget_for(experts: torch.nn.Module, num_tokens: int, num_chunks: int = 4) -> int:
    """The exact predicted layer peak at c = ``num_chunks`` (fp32): MACT's budget for that bin."""
    k = experts.config.num_experts_per_tok
    policy = _policy(experts, num_tokens, k, mf_hf.make_config(memory_budget=1).chunk)
    return policy.layer_peak(num_tokens, 4, num_chunks)


def _policy(experts, num_tokens, k, chunk):
    plan = mf_hf.plan_experts(experts)
    return hf_experts.chunk_policy(experts, plan, mf_hf.expert_weights(experts), k, chunk)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_budget_chooses_chunks(model_type: str) -> None:
    experts = experts_modules(tiny_causal_lm(model_type))[0]
    T, k = BATCH * SEQ, experts.config.num_experts_per_tok
    x_TD = torch.randn(T, experts.down_proj.shape[1 if not experts.is_transposed else 2])
    top_k_index = torch.stack([torch.randperm(int(experts.num_experts))[:k] for _ in range(T)])
    plan, weights = mf_hf.plan_experts(experts), mf_hf.expert_weights(experts)
    cfg = mf_hf.make_config(memory_budget=_budget_for(experts, T))
    assert hf_experts.num_chunks_for(experts, plan, weights, x_TD, top_k_index, cfg.chunk) == 4
    decision = mf_hf.last_decision(experts)
    assert decision is not None and decision.num_chunks == 4
    assert decision.predicted_peak_bytes <= cfg.chunk.memory_budget_bytes
    tight = mf_hf.make_config(memory_budget=_budget_for(experts, T, 8) - 1)
    with pytest.raises(ValueError, match="smallest feasible budget"):
        hf_experts.num_chunks_for(experts, plan, weights, x_TD, top_k_index, tight.chunk)


def _with_sentinels(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Every third slot becomes a sentinel (E, E + 3, alternating); token 0 all sentinels."""
    idx = top_k_index.clone()
    flat = idx.view(-1)
    sentinel = torch.tensor([num_experts, num_experts + 3]).repeat(flat.numel())[:flat.numel()]
    mask = torch.arange(flat.numel()) % 3 == 1
    flat[mask] = sentinel[mask]
    idx[0] = num_experts
    return idx


def _experts_case(experts: torch.nn.Module, T: int = 11):
    E = int(experts.num_experts)
    k = min(2, E)
    D = (experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj)
    d = D.shape[1] if getattr(experts, "is_transposed", False) else D.shape[2]
    x_TD = torch.randn(T, d)
    top_k_index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    top_k_weights = torch.rand(T, k)
    return x_TD, top_k_index, top_k_weights


def _experts_grads(experts, fn, x_TD, top_k_index, top_k_weights):
    x = x_TD.clone().requires_grad_(True)
    w = top_k_weights.clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out = fn(experts, x, top_k_index, w)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    params = {n: p.grad.clone() for n, p in experts.named_parameters()}
    return out.detach(), x.grad, w.grad, params


def _eager(experts, x, top_k_index, w):
    experts.config._experts_implementation = "eager"
    return experts(x, top_k_index, w)


@pytest.mark.parametrize("chunking", ["unchunked", "num_chunks3"])
@pytest.mark.parametrize("model_type", _experts_params())
def test_experts_with_sentinels_match_eager(model_type: str, chunking: str) -> None:
    """memfine with sentinel ids == eager with those slots' weights set to 0 (ids made valid);
    sentinel slots get exactly zero routing-weight gradient."""
    config = mf_hf.make_config(**CHUNKINGS[chunking])
    for experts in tiny_experts(model_type):
        x_TD, top_k_index, top_k_weights = _experts_case(experts)
        E = int(experts.num_experts)
        idx_s = _with_sentinels(top_k_index, E)
        is_sentinel = idx_s >= E
        w_zeroed = torch.where(is_sentinel, 0.0, top_k_weights)

        def memfine_fn(m, x, idx, w, idx_s=idx_s):
            return mf_hf.memfine_experts_forward(m, x, idx_s, w, config=config)

        out, gx, gw, gp = _experts_grads(experts, memfine_fn, x_TD, top_k_index, top_k_weights)
        ref, rgx, rgw, rgp = _experts_grads(experts, _eager, x_TD, top_k_index, w_zeroed)
        name = type(experts).__name__
        assert torch.equal(out[0], torch.zeros_like(out[0])), f"{name}: all-sentinel token"
        assert_close(out, ref, msg=f"{name} output")
        assert_close(gx, rgx, grad=True, msg=f"{name} dx")
        assert torch.equal(gw[is_sentinel], torch.zeros_like(gw[is_sentinel]))
        assert_close(gw[~is_sentinel], rgw[~is_sentinel], grad=True, msg=f"{name} dw")
        for pname, grad in gp.items():
            assert_close(grad, rgp[pname], grad=True, msg=f"{name} grad {pname}")


def test_register_reads_a_memory_budget_as_the_command_line_does() -> None:
    """A string names its unit ("16GiB"), an int is bytes; "16" is refused, not 16 bytes."""
    from memfine.integrations.torchtitan import make_options

    for given, expected in (("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20), ("80GB", 80 * 10**9),
                            (4096, 4096)):
        fn = mf_hf.register(memory_budget=given)
        assert fn.memfine_config.chunk.memory_budget_bytes == expected
        assert make_options(memory_budget=given).chunk.memory_budget_bytes == expected
    for bad in ("16", "0GiB", "-5MiB", 0, -1, "lots", 1.5, True, 2**63, "9999999999TiB"):
        with pytest.raises(ValueError) as info:
            mf_hf.register(memory_budget=bad)
        assert str(info.value).startswith(
            "memory_budget must be an int number of bytes or a string with a unit such as "
            f"'16GiB' or '512MiB' (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (any case)), > 0 "
            f"and at most 2**63 - 1 bytes, got {bad!r}"), bad
        with pytest.raises(ValueError, match=r"^memory_budget must be"):
            make_options(memory_budget=bad)
