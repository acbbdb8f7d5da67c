"""PEFT's adapter workflows on the experts' weights with memfine's experts, against eager.

Each workflow runs on a PEFT model whose experts run memfine (split LoRA after the first
forward) and on the same PEFT model with transformers' eager experts; logits agree within the
fp32 tolerances after every step: a second adapter added after a forward, ``set_adapter``
between adapters, merge / unmerge, ``delete_adapter``, ``disable_adapter``, several adapters
saved and loaded back (``save_pretrained`` / ``load_adapter``), and ``merge_and_unload`` with
several adapters.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import tiny_causal_lm  # noqa: E402

from memfine.hf.peft import is_split_wrapper  # noqa: E402
from memfine.integrations.transformers import register  # noqa: E402
from tolerances import assert_close  # noqa: E402

MODELS = ["qwen3_moe", "gpt_oss"]  # (E, d_out, d_in) and transposed (E, d_in, d_out) layouts
IDS = torch.tensor([[3, 17, 5, 40, 2, 9, 11], [8, 1, 60, 33, 7, 7, 21]])


def _config(r: int = 4, alpha: int = 8, targets: tuple[str, ...] = (
        "experts.gate_up_proj", "experts.down_proj")) -> object:
    return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=[],
                           target_parameters=list(targets), init_lora_weights=False)


def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(memfine, eager) PEFT models with equal random adapters ``default``."""
    register()
    base = tiny_causal_lm(model_type).eval()
    eager = copy.deepcopy(base)
    eager.set_experts_implementation("eager")
    base.set_experts_implementation("memfine")
    torch.manual_seed(1)
    ours = peft.get_peft_model(base, _config())
    ref = peft.get_peft_model(eager, _config())
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _same(ours: torch.nn.Module, ref: torch.nn.Module, msg: str = "") -> torch.Tensor:
    with torch.no_grad():
        out = ours(input_ids=IDS).logits
        assert_close(out, ref(input_ids=IDS).logits, msg=msg)
    return out


def _add_second(ours: torch.nn.Module, ref: torch.nn.Module, **config: object) -> None:
    torch.manual_seed(2)
    ours.add_adapter("second", _config(**config))
    ref.add_adapter("second", _config(**config))
    ref.load_state_dict(ours.state_dict())


def _both(ours: torch.nn.Module, ref: torch.nn.Module, method: str, *args: object) -> None:
    """Call PEFT's ``method(*args)`` on both models."""
    for model in (ours, ref):
        getattr(model, method)(*args)


def _wrappers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.ParamWrapper)]


@pytest.mark.parametrize("model_type", MODELS)
def test_add_adapter_after_a_forward_and_set_adapter(model_type: str, monkeypatch) -> None:
    """A second adapter is added to the wrappers memfine runs (one wrapper per weight), and
    each adapter set active runs split (PEFT's parametrization is never registered)."""
    ours, ref = _pair(model_type)
    first = _same(ours, ref, "default")  # memfine's wrappers from here on
    count = len(_wrappers(ours))
    assert count and all(is_split_wrapper(m) for m in _wrappers(ours))
    _add_second(ours, ref)
    assert len(_wrappers(ours)) == count, "the second adapter must reuse the wrappers"
    assert all("second" in m.lora_A and is_split_wrapper(m) for m in _wrappers(ours))
    assert_close(_same(ours, ref, "default after add"), first)
    layer = peft.tuners.lora.layer
    dense: list[int] = []
    original = layer.ParamWrapper._activate_lora
    for name in ("second", "default", "second"):
        ours.set_adapter(name)
        ref.set_adapter(name)
        dense.clear()
        monkeypatch.setattr(layer.ParamWrapper, "_activate_lora",
                            lambda self, a: dense.append(1) or original(self, a))
        with torch.no_grad():
            out = ours(input_ids=IDS).logits
        monkeypatch.undo()
        assert not dense, f"{name}: memfine's wrappers must not parametrize"
        assert_close(out, _same(ref, ref), msg=name)
    assert (out - first).abs().max() > 1e-3, "the second adapter must change the logits"


@pytest.mark.parametrize("model_type", MODELS)
def test_several_active_adapters_after_a_forward(model_type: str) -> None:
    ours, ref = _pair(model_type)
    _same(ours, ref)
    _add_second(ours, ref)
    _both(ours.base_model, ref.base_model, "set_adapter", ["default", "second"])
    with pytest.warns(UserWarning, match="several active adapters"):
        _same(ours, ref, "both")


@pytest.mark.parametrize("model_type", MODELS)
def test_merge_unmerge_and_disable(model_type: str) -> None:
    ours, ref = _pair(model_type)
    first = _same(ours, ref)
    _add_second(ours, ref)
    _both(ours, ref, "merge_adapter")
    assert all(m.merged for m in _wrappers(ours))
    assert_close(_same(ours, ref, "merged"), first)
    _both(ours, ref, "unmerge_adapter")
    assert not any(m.merged for m in _wrappers(ours))
    assert_close(_same(ours, ref, "unmerged"), first)
    with ours.disable_adapter(), ref.disable_adapter():
        plain = _same(ours, ref, "disabled")
    assert (plain - first).abs().max() > 1e-3
    _both(ours, ref, "merge_adapter", ["default", "second"])
    _same(ours, ref, "both merged")
    _both(ours, ref, "unmerge_adapter")
    assert_close(_same(ours, ref, "both unmerged"), first)


@pytest.mark.parametrize("model_type", MODELS)
def test_delete_adapter(model_type: str) -> None:
    ours, ref = _pair(model_type)
    _same(ours, ref)
    _add_second(ours, ref)
    _both(ours, ref, "set_adapter", "second")
    _both(ours, ref, "delete_adapter", "default")
    assert all(list(m.lora_A) == ["second"] for m in _wrappers(ours))
    assert ours.active_adapters == ["second"]
    _same(ours, ref, "second only")
    torch.manual_seed(3)
    ours.add_adapter("third", _config(r=2, alpha=4))
    ref.add_adapter("third", _config(r=2, alpha=4))
    ref.load_state_dict(ours.state_dict())
    _both(ours, ref, "set_adapter", "third")
    _same(ours, ref, "third")


@pytest.mark.parametrize("model_type", MODELS)
def test_save_and_load_several_adapters(model_type: str, tmp_path) -> None:
    ours, ref = _pair(model_type)
    _same(ours, ref)
    _add_second(ours, ref, r=2, alpha=6)
    want = {}
    for name in ("default", "second"):
        ref.set_adapter(name)
        with torch.no_grad():
            want[name] = ref(input_ids=IDS).logits
    ours.save_pretrained(tmp_path, selected_adapters=["default", "second"])
    fresh = tiny_causal_lm(model_type).eval()
    fresh.set_experts_implementation("memfine")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    with torch.no_grad():
        assert_close(loaded(input_ids=IDS).logits, want["default"], msg="loaded default")
    loaded.load_adapter(tmp_path / "second", adapter_name="second")  # after a forward
    loaded.set_adapter("second")
    assert all(is_split_wrapper(m) and set(m.lora_A) == {"default", "second"}
               for m in _wrappers(loaded))
    with torch.no_grad():
        assert_close(loaded(input_ids=IDS).logits, want["second"], msg="loaded second")
        merged = loaded.merge_and_unload(adapter_names=["second"])
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        assert_close(merged(input_ids=IDS).logits, want["second"], msg="merged second")

