"""Loading saved tiny checkpoints of every family with and without memfine's per-model options.

Four ways to set options on an ordinary checkpoint (one whose config has no ``memfine_experts``):
transformers' own ``from_pretrained(path, experts_implementation=NAME)`` with a name that
:func:`register` bound to options (nothing is written into the config),
:func:`memfine.integrations.transformers.from_pretrained`, :func:`configure` after loading, and
a checkpoint saved after :func:`configure`. Each loaded model's logits are compared with the same
checkpoint loaded with ``"eager"``, and a spy counts the chunks every MoE layer ran with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'memfine[hf]')")

import hf_models  # noqa: E402

from memfine.hf import experts as hf_experts  # noqa: E402
from memfine.integrations import transformers as mf_hf  # noqa: E402

IDS = torch.tensor([[3, 17, 5, 40, 2, 9]])


@pytest.fixture
def chunk_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``num_chunks`` of every chunked experts call (unchunked calls add nothing)."""
    calls: list[int] = []
    real = hf_experts.run_chunked

    def spy(*args, **kwargs):
        calls.append(kwargs["num_chunks"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_experts, "run_chunked", spy)
    return calls


@pytest.fixture
def checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, torch.Tensor, int]:
    """A saved tiny checkpoint (no memfine options), its eager logits, its MoE layer count."""
    try:
        model = hf_models.tiny_causal_lm(request.param)
    except ValueError as err:  # multimodal, or a layout the generic shrink cannot build
        pytest.skip(str(err))
    model.save_pretrained(tmp_path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                              experts_implementation="eager")
    with torch.no_grad():
        logits = eager(input_ids=IDS).logits
    return tmp_path, logits, len(hf_models.experts_modules(model))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _families() -> list[object]:
    """Every architecture with an experts module; the six hand-written ones in the default run."""
    return [pytest.param(a, id=a, marks=() if a in hf_models.CAUSAL_LMS else pytest.mark.slow)
            for a in sorted({*hf_models.CAUSAL_LMS, *hf_models.experts_architectures()})]


@pytest.mark.parametrize("checkpoint", _families(), indirect=True)
def test_load_with_and_without_options(checkpoint: tuple[Path, torch.Tensor, int],
                                       chunk_calls: list[int]) -> None:
    path, eager_logits, layers = checkpoint
    mf_hf.register()
    auto = transformers.AutoModelForCausalLM
    plain = auto.from_pretrained(path, experts_implementation="memfine")
    assert not hasattr(plain.config, mf_hf.CONFIG_ATTRIBUTE)
    assert_close(_logits(plain), eager_logits)
    assert chunk_calls == []  # no options: unchunked
    mf_hf.register(name="memfine_4_chunks", num_chunks=4)
    named = auto.from_pretrained(path, experts_implementation="memfine_4_chunks")
    assert not hasattr(named.config, mf_hf.CONFIG_ATTRIBUTE)
    assert_close(_logits(named), eager_logits)
    assert chunk_calls == [4] * layers
    chunk_calls.clear()
    named.save_pretrained(path / "resaved")  # the name is not written into config.json
    assert "memfine" not in (path / "resaved" / "config.json").read_text()
    loaded = mf_hf.from_pretrained(auto, path, memfine_experts={"chunk": {"num_chunks": 2}})
    assert loaded.config._experts_implementation == "memfine"
    assert_close(_logits(loaded), eager_logits)
    assert chunk_calls == [2] * layers
    chunk_calls.clear()
    mf_hf.configure(plain, num_chunks=3)
    assert_close(_logits(plain), eager_logits)
    assert chunk_calls == [3] * layers


@pytest.mark.parametrize("checkpoint", ["gpt_oss"], indirect=True)
def test_options_saved_with_the_model_load_with_the_plain_keyword(
        checkpoint: tuple[Path, torch.Tensor, int], chunk_calls: list[int],
        tmp_path: Path) -> None:
    """After configure + save_pretrained, the config defines the key: the HF keyword works."""
    path, eager_logits, layers = checkpoint
    model = mf_hf.from_pretrained(transformers.AutoModelForCausalLM, path,
                                  memfine_experts=mf_hf.make_config(num_chunks=2))
    model.save_pretrained(tmp_path / "configured")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "configured", experts_implementation="memfine",
        memfine_experts={"chunk": {"num_chunks": 4}})
    assert_close(_logits(again), eager_logits)
    assert chunk_calls == [4] * layers


@pytest.mark.parametrize("checkpoint", ["qwen3_moe"], indirect=True)
def test_transformers_keyword_on_an_ordinary_checkpoint_is_its_type_error(
        checkpoint: tuple[Path, torch.Tensor, int]) -> None:
    """transformers passes a keyword its config lacks to the model constructor (why
    :func:`memfine.integrations.transformers.from_pretrained` exists); bad options are a
    ValueError naming the key."""
    path, _, _ = checkpoint
    mf_hf.register()
    with pytest.raises(TypeError, match="memfine_experts"):
        transformers.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="memfine", memfine_experts={})
    with pytest.raises(ValueError, match="unknown keys"):
        mf_hf.from_pretrained(transformers.AutoModelForCausalLM, path,
                              memfine_experts={"chunks": 2})
