"""PEFT LoRA on the experts' weights (target_parameters) run as memfine's split LoRA.

Against PEFT on eager (which materialises W + s·B·A): logits, loss and every adapter gradient;
the split path never builds the dense update; PEFT's save/load and merge_and_unload.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import tiny_causal_lm  # noqa: E402

from memfine.hf.peft import is_split_wrapper, split_lora  # noqa: E402
from memfine.integrations.transformers import register  # noqa: E402
from tolerances import assert_close  # noqa: E402

MODELS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


def _lora_config() -> object:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=[],
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"])


def _randomise_adapters(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)


def _pair(model_type: str, split: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(memfine, eager) PEFT models with equal adapters; ``split``: :func:`split_lora` first
    (otherwise PEFT's own get_peft_model alone, with no memfine call in between)."""
    register()
    base = tiny_causal_lm(model_type)
    eager = copy.deepcopy(base)
    eager.set_experts_implementation("eager")
    base.set_experts_implementation("memfine")
    ours = peft.get_peft_model(base, _lora_config())
    ref = peft.get_peft_model(eager, _lora_config())
    _randomise_adapters(ours)
    ref.load_state_dict(ours.state_dict())
    if split:
        assert split_lora(ours) == 2 * len([m for m in base.modules()
                                            if type(m).__name__.endswith("Experts")])
    return ours, ref


@pytest.mark.parametrize("model_type", MODELS)
def test_split_lora_equals_peft_on_eager(model_type: str, monkeypatch) -> None:
    ours, ref = _pair(model_type)
    ids = torch.randint(0, 61, (2, 7))
    calls = []
    original = peft.tuners.lora.layer.ParamWrapper.get_delta_weight
    monkeypatch.setattr(peft.tuners.lora.layer.ParamWrapper, "get_delta_weight",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    out = ours(input_ids=ids, labels=ids)
    assert not calls, "the split path must never build W + s·B·A"
    monkeypatch.undo()
    want = ref(input_ids=ids, labels=ids)
    assert_close(out.logits, want.logits)
    assert_close(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    mine = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    theirs = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert mine.keys() == theirs.keys() and any("experts" in n for n in mine)
    for name, grad in mine.items():
        assert grad is not None, name
        assert_close(grad, theirs[name], grad=True, msg=name)
    frozen = [p for n, p in ours.named_parameters() if ".experts." in n and "lora_" not in n]
    assert frozen and all(p.grad is None for p in frozen)


PLAIN_PEFT_MODELS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


def _weight_sizes(model: torch.nn.Module) -> set[int]:
    return {p.numel() for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n}


def _large_saved(model: torch.nn.Module, run) -> tuple[list[tuple[int, ...]], object]:
    """Shapes of tensors saved for backward that are as large as an expert weight and are not a
    parameter's storage (W + s·B·A, its cast or its product would be)."""
    sizes = _weight_sizes(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() in sizes and t.untyped_storage().data_ptr() not in params:
            found.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return found, out


def _backward_equal(ours: torch.nn.Module, ref: torch.nn.Module, out: Any, want: Any,
                    where: str) -> None:
    """Equal losses; back-propagate both; every adapter gradient of ``ours`` equals ``ref``'s."""
    assert_close(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    theirs = dict(ref.named_parameters())
    adapters = [(n, p) for n, p in ours.named_parameters() if "lora_" in n]
    assert adapters
    for name, p in adapters:
        assert p.grad is not None, f"{where}: {name}"
        assert_close(p.grad, theirs[name].grad, grad=True, msg=f"{where}: {name}")


@pytest.mark.parametrize("model_type", PLAIN_PEFT_MODELS)
def test_plain_peft_runs_split_lora(model_type: str, monkeypatch) -> None:
    """PEFT's get_peft_model alone: loss and adapter gradients equal PEFT on eager, and the
    experts never compute with W + s·B·A (nothing of a weight's size is saved; after the first
    call PEFT's factor proxy is not even evaluated)."""
    ours, ref = _pair(model_type, split=False)
    layer = peft.tuners.lora.layer
    evaluated = []
    original = layer._LoraFactorsProxy.forward
    monkeypatch.setattr(layer._LoraFactorsProxy, "forward",
                        lambda self, w: evaluated.append(1) or original(self, w))
    ids = torch.randint(0, 61, (2, 7))
    wrappers = [m for m in ours.modules() if isinstance(m, layer.ParamWrapper)]
    assert wrappers and all(type(m) is layer.ParamWrapper for m in wrappers)
    for step in range(2):
        ours.zero_grad()
        ref.zero_grad()
        evaluated.clear()
        large, out = _large_saved(ours, lambda: ours(input_ids=ids, labels=ids))
        assert not large, f"step {step}: tensors of an expert weight's size saved: {large}"
        # PEFT's registration check evaluates each proxy once on the first call (never for
        # the experts' math); the wrappers are then memfine's and register nothing
        assert len(evaluated) == (len(wrappers) if step == 0 else 0), (step, len(evaluated))
        assert all(is_split_wrapper(m) for m in wrappers)
        want = ref(input_ids=ids, labels=ids)
        assert_close(out.logits, want.logits)
        _backward_equal(ours, ref, out, want, f"step {step}")


def test_plain_peft_dense_parametrized_weights_are_never_read(monkeypatch) -> None:
    """The experts read the original weights: the parametrized attribute is never evaluated."""
    ours, _ = _pair("qwen3_moe", split=False)
    reads = []
    original = torch.nn.utils.parametrize.ParametrizationList.forward
    monkeypatch.setattr(torch.nn.utils.parametrize.ParametrizationList, "forward",
                        lambda self: reads.append(1) or original(self))
    ids = torch.randint(0, 61, (2, 7))
    ours(input_ids=ids, labels=ids).loss.backward()
    wrappers = [m for m in ours.modules() if isinstance(m, peft.tuners.lora.layer.ParamWrapper)]
    assert len(reads) == len(wrappers)  # PEFT's registration check only (first call)


@pytest.mark.parametrize(("model_type", "split"), [
    *((m, False) for m in PLAIN_PEFT_MODELS), ("qwen3_moe", True), ("gpt_oss", True)])
def test_save_load_and_merge(model_type: str, split: bool, tmp_path) -> None:
    """PEFT's own save_pretrained, PeftModel.from_pretrained and merge_and_unload (with and
    without split_lora ahead of time)."""
    ours, _ = _pair(model_type, split=split)
    ours.eval()
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
    ours.save_pretrained(tmp_path)
    fresh = tiny_causal_lm(model_type)
    fresh.set_experts_implementation("memfine")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    if split:
        assert split_lora(loaded) > 0
    loaded.eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, logits)
        assert any(is_split_wrapper(m) for m in loaded.modules())
        merged = loaded.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        assert_close(merged(input_ids=ids).logits, logits)


def test_several_active_adapters_run_dense_with_one_warning() -> None:
    """Two active adapters: PEFT's summed ΔW, computed exactly, with a warning naming why."""
    ours, ref = _pair("qwen3_moe", split=False)
    for model in (ours, ref):
        model.add_adapter("second", _lora_config())
        model.base_model.set_adapter(["default", "second"])
    _randomise_adapters(ours)
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 61, (2, 7))
    with pytest.warns(UserWarning, match="several active adapters"):
        out = ours(input_ids=ids, labels=ids)
    assert_close(out.logits, ref(input_ids=ids, labels=ids).logits)


def test_dora_on_expert_weights_is_refused_by_peft() -> None:
    register()
    base = tiny_causal_lm("qwen3_moe")
    base.set_experts_implementation("memfine")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], use_dora=True,
                             target_parameters=["experts.gate_up_proj"])
    with pytest.raises(ValueError, match="DoRA|use_dora"):
        peft.get_peft_model(base, config)


def test_memfine_param_wrapper_keeps_peft_class_name_and_pickles() -> None:
    """PEFT finds an existing wrapper by its class name (add_adapter, load_adapter): memfine's
    subclass keeps ``ParamWrapper``; pickled by module and name."""
    import pickle

    from memfine.hf import peft as memfine_peft

    cls = memfine_peft.wrapper_class()
    assert cls.__name__ == cls.__qualname__ == "ParamWrapper"
    assert issubclass(cls, peft.tuners.lora.layer.ParamWrapper)
    assert pickle.loads(pickle.dumps(cls)) is cls
    ours, _ = _pair("qwen3_moe")
    wrapper = next(m for m in ours.modules() if is_split_wrapper(m))
    assert repr(wrapper).startswith("lora.ParamWrapper(")


def _steps_equal(ours: torch.nn.Module, ref: torch.nn.Module, steps: int) -> None:
    """Forward + backward ``steps`` times (no optimizer): loss and adapter gradients equal."""
    ids = torch.randint(0, 61, (2, 7))
    for step in range(steps):
        ours.zero_grad()
        ref.zero_grad()
        out, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        _backward_equal(ours, ref, out, want, f"step {step}")


def test_plain_peft_with_chunks_and_recompute_equals_eager() -> None:
    """Two token chunks under recompute: the adapters found at call time serve the recompute."""
    ours, ref = _pair("qwen3_moe", split=False)
    register(num_chunks=2)
    try:
        _steps_equal(ours, ref, 2)  # PEFT's parametrization, then the converted wrappers
    finally:
        register()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_plain_peft_under_gradient_checkpointing_equals_eager(reentrant: bool) -> None:
    """HF gradient checkpointing (TRL's SFTTrainer default): the wrappers converted during the
    first forward keep PEFT's path for its recompute in backward, which must save what that
    forward saved; from the second step on the forward and its recompute both split."""
    ours, ref = _pair("qwen3_moe", split=False)
    for model in (ours, ref):
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()
    _steps_equal(ours, ref, 3)
    assert all(is_split_wrapper(m) for m in ours.modules()
               if isinstance(m, peft.tuners.lora.layer.ParamWrapper))


def test_plain_peft_budget_counts_the_adapters() -> None:
    """Under a memory budget, PEFT's adapters enter MACT's memory model (a LoRA layer's peak)."""
    from memfine.hf.experts import last_decision
    from memfine.memory.layer import layer_peak_bytes
    from memfine.memory.lora import lora_layer_memory
    from memfine.schedule.lora_policy import LoRAChunkPolicy

    ours, ref = _pair("qwen3_moe", split=False)
    register(memory_budget="64MiB")
    try:
        ids = torch.randint(0, 61, (2, 7))
        out, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        assert_close(out.loss, want.loss)
        experts = [m for m in ours.modules() if type(m).__name__.endswith("Experts")
                   and hasattr(m, "_memfine_chunk_policy")]
        assert experts
        for module in experts:
            policy = module._memfine_chunk_policy
            assert isinstance(policy, LoRAChunkPolicy)
            assert (policy.lora.rank, policy.lora.alpha, policy.lora.targets) == (
                4, 8.0, ("w_up", "w_down"))
            decision = last_decision(module)
            assert decision is not None
            T = ids.numel()
            want_peak = lora_layer_memory(policy.moe, policy.lora, T, 4,
                                          num_chunks=decision.num_chunks,
                                          recompute=policy.config.resolved_recompute).peak_bytes
            assert decision.predicted_peak_bytes == want_peak
            plain = layer_peak_bytes(policy.moe, T, 4, num_chunks=decision.num_chunks,
                                     recompute=policy.config.resolved_recompute)
            # a frozen base has no weight gradients, the adapters add their own bytes
            assert want_peak != plain
    finally:
        register()
