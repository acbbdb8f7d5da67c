"""config.json → model sizes: one hand-written tiny config per model_type, sizes worked by hand."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from memfine.plan.hf_config import PARSERS, load_hf_config, model_from_hf_config
from memfine.plan.presets import get_preset

ASSETS = Path(__file__).parents[1] / "assets" / "hf_configs"
SIZES = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "num_layers",
         "num_dense_layers", "dense_intermediate_size", "num_shared_experts",
         "shared_intermediate_size", "num_heads", "num_kv_heads", "head_dim",
         "attention_params", "vocab_size", "tied_embeddings")

# Expected sizes, by hand from the files (attention: Q, K, V, O projections + biases + norms).
EXPECTED: dict[str, tuple[Any, ...]] = {
    # 1 leading dense layer (mlp_only_layers [0]); q/k norms 2·16
    "qwen3_moe": (64, 32, 8, 2, 4, 1, 128, 0, 0, 4, 2, 16,
                  2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 2 * 16, 1000, False),
    # one shared expert of 96; q, k, v biases (4 + 2·4)·16; head_dim 64/4
    "qwen2_moe": (64, 32, 6, 2, 3, 0, 0, 1, 96, 4, 4, 16,
                  2 * 64 * 64 + 2 * 64 * 64 + 12 * 16, 500, False),
    # MLA: q_a 64·32 + norm 32 + q_b 32·4·(8+4); kv_a 64·(16+4) + norm 16; kv_b 16·4·(8+8);
    # o 4·8·64; head_dim = v_head_dim 8; 2 shared experts of width n
    "deepseek_v3": (64, 16, 16, 4, 3, 1, 96, 2, 16, 4, 4, 8,
                    64 * 32 + 32 + 32 * 4 * 12 + 64 * 20 + 16 + 16 * 4 * 16 + 4 * 8 * 64,
                    300, False),
    "mixtral": (32, 64, 4, 2, 2, 0, 0, 0, 0, 4, 2, 8, 2 * 32 * 32 + 2 * 32 * 16, 100, False),
    # q norm over d, k norm over k_a·h_d
    "olmoe": (32, 16, 8, 2, 2, 0, 0, 0, 0, 4, 4, 8, 4 * 32 * 32 + 32 + 32, 100, True),
    # q, k, v, o biases (4 + 2·2)·8 + 32; experts_per_token spelling
    "gpt_oss": (32, 32, 4, 2, 2, 0, 0, 0, 0, 4, 2, 8,
                2 * 32 * 32 + 2 * 32 * 16 + 8 * 8 + 32, 100, False),
}


def test_every_supported_model_type_has_a_case() -> None:
    assert set(EXPECTED) == set(PARSERS) == {p.stem for p in ASSETS.glob("*.json")}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_sizes_by_hand(model_type: str) -> None:
    model = load_hf_config(ASSETS / f"{model_type}.json")
    assert tuple(getattr(model, f) for f in SIZES) == EXPECTED[model_type]
    assert model.setting is None and f"model_type {model_type}" in model.source


def test_model_directory(tmp_path: Path) -> None:
    (tmp_path / "Tiny-MoE").mkdir()
    (tmp_path / "Tiny-MoE" / "config.json").write_text((ASSETS / "mixtral.json").read_text())
    model = load_hf_config(tmp_path / "Tiny-MoE")
    assert model.name == "Tiny-MoE" and model.hidden_size == 32


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("edit", "match"), [
    ({"model_type": "llama"}, r"model_type must be one of \['deepseek_v3', .*got 'llama'"),
    ({"num_experts_per_tok": None}, "missing field num_experts_per_tok or experts_per_token"),
    ({"hidden_size": "64"}, "hidden_size must be an int >= 0, got '64'"),
    ({"hidden_size": 0}, "ModelPreset.hidden_size must be >= 1, got 0"),
    ({"num_experts_per_tok": 9}, r"ModelPreset.top_k must be in \[1, 8\], got 9"),
    ({"mlp_only_layers": [1]}, r"dense layers at \[1\]; memfine plan models leading dense"),
    ({"decoder_sparse_step": 2}, r"dense layers at \[0, 2\]"),
])
def test_faults_name_the_field(tmp_path: Path, edit: dict[str, Any], match: str) -> None:
    data = {**json.loads((ASSETS / "qwen3_moe.json").read_text()), "mlp_only_layers": []}
    data.update(edit)
    with pytest.raises(ValueError, match=match):
        load_hf_config(_write(tmp_path, {k: v for k, v in data.items() if v is not None}))


def test_file_faults(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_hf_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no such file"):
        load_hf_config(tmp_path)  # a directory without config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{\"model_type\": ")
    with pytest.raises(ValueError, match=r"is not JSON \(Expecting value, line 1\)"):
        load_hf_config(bad)
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        load_hf_config(_write(tmp_path, [1, 2]))


@pytest.mark.parametrize(("preset", "cls", "kwargs"), [
    ("deepseek-v3", "DeepseekV3Config", {}),
    ("qwen3-30b-a3b", "Qwen3MoeConfig", {"num_hidden_layers": 48, "head_dim": 128}),
    ("mixtral-8x7b", "MixtralConfig", {}),
    ("olmoe-1b-7b", "OlmoeConfig", {"intermediate_size": 1024}),
])
def test_transformers_configs_give_the_presets(preset: str, cls: str,
                                               kwargs: dict[str, Any]) -> None:
    """transformers' own config classes (defaults = the published models, plus the fields the
    class defaults differently) parse to the preset's sizes: an independent check of the keys."""
    transformers = pytest.importorskip("transformers")
    data = getattr(transformers, cls)(**kwargs).to_dict()
    model = model_from_hf_config(data, name=preset, where="config.json")
    expected = dataclasses.replace(get_preset(preset), source=model.source, setting=None)
    assert model == expected
