"""PEFT LoRA on the experts' weights (target_parameters) run as memfine's split LoRA.

Against PEFT on eager (which materialises W + s·B·A): logits, loss and every adapter gradient;
the split path never builds the dense update; PEFT's save/load and merge_and_unload.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import tiny_causal_lm  # noqa: E402

from memfine.integrations.hf.peft import split_lora  # noqa: E402
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


def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    register()
    base = tiny_causal_lm(model_type)
    eager = copy.deepcopy(base)
    eager.set_experts_implementation("eager")
    base.set_experts_implementation("memfine")
    ours = peft.get_peft_model(base, _lora_config())
    ref = peft.get_peft_model(eager, _lora_config())
    _randomise_adapters(ours)
    ref.load_state_dict(ours.state_dict())
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


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_save_load_and_merge(model_type: str, tmp_path) -> None:
    ours, _ = _pair(model_type)
    ours.eval()
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
    ours.save_pretrained(tmp_path)
    fresh = tiny_causal_lm(model_type)
    fresh.set_experts_implementation("memfine")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    assert split_lora(loaded) > 0
    loaded.eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, logits)
        merged = loaded.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        assert_close(merged(input_ids=ids).logits, logits)
