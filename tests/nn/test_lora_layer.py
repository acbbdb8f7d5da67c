"""MoELayer with LoRA adapters: reference values, chunked == unchunked, freezing, merge, errors."""

from __future__ import annotations

import pytest
import torch

from memfine.config import ChunkConfig, MoEConfig
from memfine.config.lora import LoRAConfig
from memfine.nn import MoELayer
from memfine.nn.lora import LoRAGroupedExperts, apply_lora, merge_lora_, merge_model_lora_
from memfine.reference import reference_experts
from tolerances import assert_chunked_close, assert_close

D, N, E, K = 16, 12, 4, 2


def _layer(chunk: ChunkConfig | None = None, **lora: object) -> MoELayer:
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    layer = MoELayer(config, chunk=chunk, lora=LoRAConfig(rank=3, alpha=6.0, **lora))
    with torch.no_grad():
        layer.experts.lora_b_up.normal_(std=0.1)
        layer.experts.lora_b_down.normal_(std=0.1)
    return layer


def _grads(layer: MoELayer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out, _ = layer(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads["x"], grads["out"] = x.grad.clone(), out.detach()
    x.grad = None
    layer.zero_grad()
    return grads


def test_experts_match_reference_with_merged_weights() -> None:
    experts = _layer().experts
    x = torch.randn(10, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(10)])
    w = torch.rand(10, K)
    merged = merge_lora_(experts)
    assert_close(experts(x, idx, w), reference_experts(x, idx, w, merged.w_up, merged.w_down))


@pytest.mark.parametrize("c", [2, 3, 8])
def test_chunked_equals_unchunked(c: int) -> None:
    x = torch.randn(2, 9, D, requires_grad=True)
    want = _grads(_layer(), x)
    got = _grads(_layer(ChunkConfig(num_chunks=c, recompute="experts")), x)
    assert want.keys() == got.keys() and "experts.lora_a_up" in want
    for name, value in want.items():
        if "lora_" in name:  # weight gradients summed chunk by chunk: the fp32 row (style §6)
            assert_close(got[name], value, grad=True, msg=name)
        else:
            assert_chunked_close(got[name], value, name)


def test_only_adapters_train_by_default() -> None:
    layer = _layer()
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {"experts.lora_a_up", "experts.lora_b_up", "experts.lora_a_down",
                         "experts.lora_b_down"}
    grads = _grads(layer, torch.randn(12, D, requires_grad=True))
    assert "experts.w_up" not in grads and "router.weight" not in grads


def test_apply_lora_starts_at_the_base_model() -> None:
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    model = torch.nn.Sequential(MoELayer(config))
    x = torch.randn(8, D)
    base = model[0](x)[0]
    assert apply_lora(model, LoRAConfig(rank=2, train_router=True)) == 1
    assert isinstance(model[0].experts, LoRAGroupedExperts)
    assert torch.equal(model[0](x)[0], base)  # B = 0 at start
    assert model[0].router.weight.requires_grad


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 0}, r"LoRAConfig.rank must be >= 1, got 0"),
    ({"rank": 13}, r"must be in \[1, min\(d_in, d_out\)=12\]"),
    ({"dropout": 1.0}, r"LoRAConfig.dropout must be in \[0.0, 1.0\)"),
    ({"targets": ("w_gate",)}, r"LoRAConfig.targets must be a non-empty subset"),
])
def test_bad_config_is_one_line_error(kwargs: dict, message: str) -> None:
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match=message) as err:
        MoELayer(config, lora=LoRAConfig(**kwargs))
    assert "\n" not in str(err.value)


def test_merge_lora_names_the_function_for_a_layer_or_model() -> None:
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    for wrong in (MoELayer(config), MoELayer(config).experts):
        with pytest.raises(TypeError, match=f"merge_lora_ takes a LoRAGroupedExperts module, "
                                            f"got {type(wrong).__name__}; merge a whole model "
                                            f"or layer with merge_model_lora_"):
            merge_lora_(wrong)  # type: ignore[arg-type]


def test_targets_in_any_order_are_one_config() -> None:
    # a run made with --lora-targets w_up,w_down resumes with w_down,w_up: the same adapters
    assert LoRAConfig(targets=("w_down", "w_up")) == LoRAConfig(targets=("w_up", "w_down"))
    assert LoRAConfig(targets=["w_down", "w_up"]).targets == ("w_up", "w_down")
    assert LoRAConfig.from_dict(LoRAConfig(targets=("w_down",)).to_dict()).targets == ("w_down",)


def test_merging_keeps_the_base_weights_frozen() -> None:
    """After merge_model_lora_ nothing is trainable that was frozen under the adapters."""
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    model = torch.nn.Sequential(MoELayer(config))
    apply_lora(model, LoRAConfig(rank=2, train_router=True))
    assert merge_model_lora_(model) == 1
    assert type(model[0].experts).__name__ == "GroupedExperts"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"0.router.weight"}  # the trained router stays trained, w_* frozen
    experts = _layer().experts
    experts.w_up.requires_grad_(True)  # a trainable base stays trainable
    merged = merge_lora_(experts)
    assert merged.w_up.requires_grad and not merged.w_down.requires_grad


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("lora_a_up", (E, 1, D), "ExpertLoRA.a_up (4, 1, 16) has rank 1 while b_up (4, 24, 3) has "
     "rank 3: A (E, r, d_in) and B (E, d_out, r) of one adapter must have the same r"),
    ("lora_b_down", (E, D, 2), "ExpertLoRA.a_down (4, 3, 12) has rank 3 while b_down "
     "(4, 16, 2) has rank 2: A (E, r, d_in) and B (E, d_out, r) of one adapter must have the "
     "same r"),
    ("lora_a_up", (E, 3, D + 1), "ExpertLoRA.a_up must be (E, r, d_in)=(4, r, 16), got "
     "(4, 3, 17)"),
    ("lora_b_up", (E, 2 * N + 1, 3), "ExpertLoRA.b_up must be (E, d_out, r)=(4, 24, r), got "
     "(4, 25, 3)"),
])
def test_replaced_adapter_of_another_shape_is_named(name: str, shape: tuple[int, ...],
                                                    message: str) -> None:
    layer = _layer()
    setattr(layer.experts, name, torch.nn.Parameter(torch.zeros(shape)))
    with pytest.raises(ValueError) as err:
        layer(torch.randn(6, D))
    assert str(err.value) == message


@pytest.mark.parametrize("train_attention", [False, True])
def test_shared_experts_are_frozen_unless_train_attention(train_attention: bool) -> None:
    """As apply_lora on a model: what is not adapted is frozen unless a flag trains it."""
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K,
                       num_shared_experts=1, shared_expert_gate=True)
    lora = LoRAConfig(rank=2, train_attention=train_attention)
    layer = MoELayer(config, lora=lora)
    shared = {"shared_experts.experts.w_up", "shared_experts.experts.w_down",
              "shared_experts.gate"}
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {f"experts.lora_{ab}_{w}" for ab in "ab" for w in ("up", "down")} | (
        shared if train_attention else set())
    grads = _grads(layer, torch.randn(12, D, requires_grad=True))
    assert shared <= grads.keys() if train_attention else not shared & grads.keys()
    model = torch.nn.Sequential(MoELayer(config))
    apply_lora(model, lora)  # the model level agrees
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"0.{n}" for n in trainable}


def test_compiled_lora_layer_equals_eager_over_row_blocks() -> None:
    """fullgraph compile (AOT autograd, no inductor codegen) of a LoRA layer whose eager run
    streams the adapters' terms over several row blocks: one graph, eager's values and grads."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    config = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K,
                       backward_block_bytes=5 * (3 * D + 3 * N + 2 * N) * 4)  # 5-row blocks
    layer = MoELayer(config, lora=LoRAConfig(rank=3, alpha=6.0))
    with torch.no_grad():
        layer.experts.lora_b_up.normal_(std=0.1)
        layer.experts.lora_b_down.normal_(std=0.1)
    x = torch.randn(12, D, requires_grad=True)
    want = _grads(layer, x)
    dynamo.reset()
    with dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        got = {k.removeprefix("_orig_mod."): v
               for k, v in _grads(compiled, x).items()}  # type: ignore[arg-type]
    assert set(got) == set(want) and any(name.startswith("experts.lora_") for name in got)
    for name in want:
        assert_close(got[name], want[name], grad=name != "out", msg=name)
