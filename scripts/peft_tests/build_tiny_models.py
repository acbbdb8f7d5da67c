"""Build the tiny models PEFT's ``tests/test_target_parameters.py`` loads, under their Hub ids.

The Hub is not reached: each model is a randomly initialised tiny config written into a local
Hugging Face cache (``<cache>/models--<org>--<name>/snapshots/<rev>/`` with ``refs/main``), so that
``from_pretrained("<org>/<name>")`` finds it with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE=<cache>``.
Sizes follow the shape of the published tiny models (two layers, four experts, two per token,
hidden size 8 for GPT-OSS, bf16 where the original is), not their weights; PEFT's tests re-draw or
upcast the weights of the two MoE models themselves (``MyAutoModelForCausalLM``).

Usage: python build_tiny_models.py CACHE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

REVISION = "0" * 40  # the snapshot every model is stored under (refs/main points at it)
VOCAB = 128

MODELS = {  # Hub id -> (config class, model class, config kwargs, dtype)
    "trl-internal-testing/tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), torch.bfloat16),
    "trl-internal-testing/tiny-Llama4ForCausalLM": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        num_hidden_layers=2, intermediate_size=32, intermediate_size_mlp=32,
        num_local_experts=4, num_experts_per_tok=1), torch.float32),
    "hf-internal-testing/tiny-random-LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        intermediate_size=37), torch.float32),
}


def build(cache: Path) -> None:
    """Write every model of :data:`MODELS` into the cache ``cache`` (existing ones are kept)."""
    for hub_id, (config_name, model_name, kwargs, dtype) in MODELS.items():
        repo = cache / ("models--" + hub_id.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        if (snapshot / "config.json").is_file():
            continue
        config = getattr(transformers, config_name)(vocab_size=VOCAB, **kwargs)
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config).to(dtype)
        model.save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        print(f"built {hub_id} in {snapshot}")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
