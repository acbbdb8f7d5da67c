"""Reading transformers experts modules: weight views, paths, options, saved bytes, DTensors."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from spies import record_kwarg
from tolerances import assert_chunked_close, assert_close

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'memfine[hf]')")

from hf_models import experts_modules, tiny_causal_lm, tiny_experts  # noqa: E402

from memfine.config import ChunkConfig, GatedActivation  # noqa: E402
from memfine.hf import experts as hf_experts  # noqa: E402
from memfine.integrations import transformers as mf_hf  # noqa: E402
from memfine.measure.saved import SavedTensorsTracker  # noqa: E402
from memfine.schedule import policy as policy_module  # noqa: E402


def _eager(experts, x, idx, w):
    experts.config._experts_implementation = "eager"
    return experts(x, idx, w)


def _case(T: int = 9, d: int = 16, E: int = 5, k: int = 2):
    x_TD = torch.randn(T, d, requires_grad=True)
    idx = torch.argsort(torch.rand(T, E), dim=1)[:, :k].contiguous()  # k distinct experts
    w = torch.rand(T, k, requires_grad=True)
    return x_TD, idx, w


def test_weights_are_views_of_the_parameters() -> None:
    (experts,) = tiny_experts("qwen3_moe")
    weights = mf_hf.expert_weights(experts)
    assert weights.w_up_EDG.data_ptr() == experts.gate_up_proj.data_ptr()
    assert weights.w_down_END.data_ptr() == experts.down_proj.data_ptr()
    assert torch.equal(weights.w_up_EDG, experts.gate_up_proj.transpose(1, 2))
    assert weights.b_up_EG is None and weights.b_down_ED is None
    (transposed,) = tiny_experts("gpt_oss")
    weights = mf_hf.expert_weights(transposed)
    assert weights.w_up_EDG is transposed.gate_up_proj
    assert weights.b_down_ED is transposed.down_proj_bias


GPT_OSS = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0, interleaved=True)


@pytest.mark.parametrize(("model_type", "path", "activation", "reason"), [
    ("qwen3_moe", "fused", "swiglu", ""),
    ("gemma4", "fused", "geglu", ""),
    ("lfm2_moe", "fused", "swiglu", ""),
    ("gpt_oss", "fused", GPT_OSS, ""),
    ("openai_privacy_filter", "fused", dataclasses.replace(GPT_OSS, interleaved=False), ""),
    ("deepseek_v4", "fused", GatedActivation(limit=10.0), ""),
    ("beam", "fused", GatedActivation(upcast=True), ""),
    ("inkling2", "plain", None, "no GatedActivation reproduces"),
    ("nemotron_h", "fused", "relu2", ""),
    ("muse_spark", "plain", None, "has_post_expert_norm"),
], ids=lambda v: str(v))
def test_plan(model_type: str, path: str, activation: object, reason: str) -> None:
    plan = mf_hf.plan_experts(tiny_experts(model_type)[0])
    assert (plan.path, plan.activation) == (path, activation)
    assert reason in plan.reason


def test_plan_follows_the_module_attributes() -> None:
    """The cached plan is rebuilt when an attribute it read changes (GPT-OSS's limit here)."""
    (experts,) = tiny_experts("gpt_oss")
    assert mf_hf.plan_experts(experts).activation == GPT_OSS
    experts.limit = 3.0
    assert mf_hf.plan_experts(experts).activation == dataclasses.replace(GPT_OSS, limit=3.0)


def test_unmatched_gate_stays_plain_and_exact() -> None:
    """A custom gate no GatedActivation reproduces (here: a squared SiLU) takes the plain path."""
    (experts,) = tiny_experts("qwen3_moe")
    default = type(experts)._apply_gate
    type(experts)._apply_gate = lambda self, h: torch.nn.functional.silu(h[:, :10]) ** 2 * h[:, 10:]
    try:
        plan = mf_hf.plan_experts(experts)
        assert plan.path == "plain" and "no GatedActivation reproduces" in plan.reason
        x, idx, w = _case()
        experts.config._experts_implementation = "batched_mm"  # calls _apply_gate, as we do
        assert_close(mf_hf.memfine_experts_forward(experts, x, idx, w), experts(x, idx, w))
    finally:
        type(experts)._apply_gate = default


def test_impl_fused_is_refused_where_it_would_be_wrong() -> None:
    (experts,) = tiny_experts("inkling2")
    x, idx, w = _case(d=experts.gate_up_proj.shape[-1], E=experts.num_experts)
    with pytest.raises(ValueError, match="impl='fused' is not possible for Inkling2Experts"):
        mf_hf.memfine_experts_forward(experts, x, idx, w,
                                      config=mf_hf.HFExpertsConfig(impl="fused"))


@pytest.mark.parametrize("impl", ["fused", "plain"])
def test_impl_and_backends_match_eager(impl: str) -> None:
    (experts,) = tiny_experts("qwen3_moe")
    x, idx, w = _case()
    ref = _eager(experts, x, idx, w)
    for backend in ("auto", "loop"):
        cfg = mf_hf.HFExpertsConfig(impl=impl, gemm_backend=backend, index_builder="argsort")
        assert_close(mf_hf.memfine_experts_forward(experts, x, idx, w, config=cfg), ref)


def test_empty_batch() -> None:
    (experts,) = tiny_experts("qwen3_moe")
    x, idx, w = _case(T=0)
    out = mf_hf.memfine_experts_forward(experts, x, idx, w)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(experts.gate_up_proj.grad, torch.zeros_like(experts.gate_up_proj))


def test_shape_errors_name_the_argument() -> None:
    (experts,) = tiny_experts("qwen3_moe")
    x, idx, w = _case()
    with pytest.raises(ValueError, match=r"hidden_states must be \(T, d\) with d=16"):
        mf_hf.memfine_experts_forward(experts, x[:, :7], idx, w)
    with pytest.raises(ValueError, match="top_k_index and top_k_weights must be"):
        mf_hf.memfine_experts_forward(experts, x, idx, w[:, :1])


def test_config_validation_and_round_trip() -> None:
    with pytest.raises(ValueError, match="HFExpertsConfig.impl must be one of"):
        mf_hf.HFExpertsConfig(impl="fast")
    cfg = mf_hf.make_config(num_chunks=3, memory_budget="1MiB", gemm_backend="loop")
    assert cfg.chunk == ChunkConfig(num_chunks=3, memory_budget_bytes=1 << 20)
    assert mf_hf.HFExpertsConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        mf_hf.HFExpertsConfig.from_dict({"chunk": {"num_chunk": 2}})


def test_too_old_or_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    old = types.SimpleNamespace(__version__="5.6.0")
    monkeypatch.setattr(mf_hf, "require", lambda name: old)
    with pytest.raises(ImportError, match=r"transformers>=5\.7\.0.*found 5\.6\.0"):
        mf_hf.register()

    def missing(name: str) -> None:
        raise ImportError(f"{name} is required")

    monkeypatch.setattr(mf_hf, "require", missing)
    with pytest.raises(ImportError, match=r"needs transformers>=5\.7\.0: pip install"):
        mf_hf.register()


def test_register_and_configure_round_trip(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = mf_hf.require_transformers()
    fn = mf_hf.register()
    assert moe.ExpertsInterface._global_mapping["memfine"] is fn
    model = tiny_causal_lm("qwen3_moe")
    mf_hf.configure(model, num_chunks=2)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, experts_implementation="memfine")
    assert loaded.config._experts_implementation == "memfine"
    assert mf_hf.HFExpertsConfig.from_dict(loaded.config.memfine_experts).chunk.num_chunks == 2
    calls = []
    real = hf_experts.run_chunked

    def spy(*args, **kwargs):
        calls.append(kwargs["num_chunks"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_experts, "run_chunked", spy)
    ids = torch.randint(0, 61, (1, 5))
    logits = loaded(input_ids=ids).logits
    assert calls == [2, 2]  # two MoE layers, the model's own option (register() has none)
    loaded.set_experts_implementation("eager")
    assert_close(logits, loaded(input_ids=ids).logits)


def _saved_bytes(experts, x, idx, w, cfg) -> int:
    with SavedTensorsTracker(exclude=experts.parameters()) as saved:
        mf_hf.memfine_experts_forward(experts, x, idx, w, config=cfg)
    return saved.total_bytes


def test_saved_bytes_are_x_plus_h_and_drop_with_chunks() -> None:
    (experts,) = tiny_experts("qwen3_moe")
    T, k, E, d, G = 9, 2, 5, 16, 20
    x, idx, w = _case(T=T, d=d, E=E, k=k)
    S = T * k
    fused = _saved_bytes(experts, x, idx, w, mf_hf.HFExpertsConfig())
    # x (T·d) + H (S·G) + weights (T·k) in fp32; int32 expert_token_indices, expert_slot_indices
    # (S each), token_index_map (T·k), expert_token_offsets (E + 1).
    assert fused == 4 * (T * d + S * G + T * k) + 4 * (2 * S + T * k + E + 1)
    chunked = _saved_bytes(experts, x, idx, w, mf_hf.make_config(num_chunks=3))
    # recompute keeps the chunk inputs only: x, top_k_index (int64), top_k_weights.
    assert chunked == 4 * T * d + 8 * T * k + 4 * T * k
    plain = _saved_bytes(experts, x, idx, w, mf_hf.HFExpertsConfig(impl="plain"))
    assert plain > fused


def test_dtensor_weights_match_plain_tensors() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    (experts,) = tiny_experts("qwen3_moe")
    x, idx, w = _case()
    ref = mf_hf.memfine_experts_forward(experts, x, idx, w)
    ref.sum().backward()
    ref_grad = experts.gate_up_proj.grad.clone()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for placement in (Replicate(), Shard(0)):
            for name in ("gate_up_proj", "down_proj"):
                plain = getattr(experts, name)
                setattr(experts, name, torch.nn.Parameter(
                    distribute_tensor(plain.detach(), mesh, [placement])))
            out = mf_hf.memfine_experts_forward(experts, x, idx, w)
            assert not isinstance(out, DTensor)
            assert_close(out, ref)
            out.sum().backward()
            assert_close(experts.gate_up_proj.grad.full_tensor(), ref_grad, grad=True)
            for name in ("gate_up_proj", "down_proj"):
                setattr(experts, name, torch.nn.Parameter(
                    getattr(experts, name).detach().full_tensor()))
    finally:
        dist.destroy_process_group()


def test_model_experts_modules_are_found() -> None:
    model = tiny_causal_lm("deepseek_v3")
    assert len(experts_modules(model)) == 1  # first_k_dense_replace=1: one MoE layer of two
    with pytest.raises(ValueError, match="has no transformers experts module"):
        mf_hf.configure(torch.nn.Linear(2, 2))


def test_budget_of_an_ungated_relu2_module_is_its_own_config() -> None:
    """ReLU² (Nemotron-H) is a named activation: the policy's config carries it, and it keeps H
    as SiLU does, so its chunk choice is the ungated SiLU one."""
    (experts,) = tiny_experts("nemotron_h")
    weights = mf_hf.expert_weights(experts)
    plan = mf_hf.plan_experts(experts)
    assert plan.activation == "relu2"
    E, D, _, _ = weights.shape_EDGN
    x_TD, idx, _ = _case(T=64, d=D, E=E)
    chunk = ChunkConfig(memory_budget_bytes=1, allow_over_budget=True)
    silu_plan = dataclasses.replace(plan, activation="silu")
    with pytest.warns(UserWarning, match="allow_over_budget"):  # 1 byte: over budget at c = 8
        c = hf_experts.num_chunks_for(experts, plan, weights, x_TD, idx, chunk)
        c_silu = hf_experts.num_chunks_for(types.SimpleNamespace(), silu_plan, weights, x_TD,
                                           idx, chunk)
    assert experts._memfine_chunk_policy.moe.activation == "relu2"
    assert c == c_silu == 8


def test_a_budget_runs_its_row_blocks_on_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget met at c = 1 only with smaller row blocks runs c = 1 with those blocks (a ladder
    of 64, 16 and 4 rows stands in for the device's MiB sizes) and equals the unbudgeted call."""
    (experts,) = tiny_experts("qwen3_moe")
    weights, plan = mf_hf.expert_weights(experts), mf_hf.plan_experts(experts)
    assert plan.path == "fused"
    E, D, G, N = weights.shape_EDGN
    x_TD, idx, w = _case(T=64, d=D, E=E)
    ladder = (64, 16, 4)
    monkeypatch.setattr(policy_module, "ladder_block_rows", lambda moe, dt, device: ladder)
    probe = hf_experts.chunk_policy(types.SimpleNamespace(), plan, weights, idx.shape[1],
                               ChunkConfig(memory_budget_bytes=1))
    peaks = [probe.layer_peak(64, 4, 1, block_rows=b) for b in ladder]
    assert peaks[0] > peaks[-1]
    blocks = record_kwarg(monkeypatch, hf_experts, "run_experts", "block_rows")
    got = mf_hf.run_module(experts, plan, weights, x_TD, idx, w,
                           chunk=ChunkConfig(memory_budget_bytes=peaks[-1]))
    decision = hf_experts.last_decision(experts)
    assert decision is not None and decision.num_chunks == 1
    want_block = next(b for b, p in zip(ladder, peaks, strict=True) if p <= peaks[-1])
    assert decision.block_rows == want_block != ladder[0]
    assert set(blocks) == {want_block}
    want = mf_hf.run_module(experts, plan, weights, x_TD, idx, w, chunk=ChunkConfig())
    assert_chunked_close(got, want, "out")
