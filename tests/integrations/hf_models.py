"""Tiny random transformers MoE models and experts modules for the integration tests.

Sizes are deliberately odd where the architecture allows it (expert intermediate size n = 30:
``torch._grouped_mm`` needs fp32 inner dimensions that are multiples of 4, so transformers' own
``grouped_mm`` experts fail there; memfine falls back per GEMM).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

N_ODD = 30  # expert intermediate size that is not a multiple of 4

# model_type -> (config class name, model class name, config kwargs)
CAUSAL_LMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=N_ODD, num_experts=6,
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        decoder_sparse_step=1, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=N_ODD, num_experts=5,
        num_experts_per_tok=2, shared_expert_intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=2, decoder_sparse_step=1)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        hidden_size=32, intermediate_size=N_ODD, num_experts=6, num_experts_per_tok=3,
        num_attention_heads=4, num_key_value_heads=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=32, intermediate_size=N_ODD, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=N_ODD, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=1.5)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=32, intermediate_size=N_ODD, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])),
}
COMMON = dict(vocab_size=61, num_hidden_layers=2, max_position_embeddings=64, use_cache=False)


def tiny_causal_lm(model_type: str, seed: int = 0) -> nn.Module:
    """A randomly initialised tiny ``*ForCausalLM`` of ``model_type`` in fp32, train mode.

    Expert weights are re-drawn with std 0.3 so that the experts' contribution to the logits is
    not negligible next to the residual stream.
    """
    transformers = importlib.import_module("transformers")
    config_name, model_name, kwargs = CAUSAL_LMS[model_type]
    config = getattr(transformers, config_name)(**COMMON, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(std=0.3)
    return model


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The transformers experts modules of ``model``."""
    return [m for m in model.modules() if hasattr(m, "_apply_gate") and hasattr(m, "down_proj")]


def experts_architectures() -> list[str]:
    """model_type of every installed transformers architecture using the experts interface."""
    root = Path(importlib.import_module("transformers").__file__).parent / "models"
    return sorted(f.parent.name for f in root.glob("*/modeling_*.py")
                  if "@use_experts_implementation" in f.read_text())


_SHRINK = {"hidden_size": 16, "intermediate_size": 10, "moe_intermediate_size": 10,
           "expert_intermediate_size": 10, "num_experts": 5, "num_local_experts": 5,
           "n_routed_experts": 5, "num_experts_per_tok": 2}


def _config_candidates(model_type: str) -> list[Any]:
    module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    classes = [c for n, c in vars(module).items() if inspect.isclass(c) and n.endswith("Config")
               and c.__module__ == module.__name__]
    candidates = []
    for cls in sorted(classes, key=lambda c: ("Text" not in c.__name__, c.__name__)):
        try:
            config = cls()
        except Exception:  # noqa: BLE001 - a config class that needs arguments is skipped
            continue
        candidates.append(config)
        candidates.extend(getattr(config, key) for key in getattr(config, "sub_configs", {})
                          if getattr(config, key, None) is not None)
    return candidates


def _shrink(config: Any) -> None:
    for key, value in _SHRINK.items():
        current = getattr(config, key, "absent")
        if current is None or (isinstance(current, int) and not isinstance(current, bool)):
            setattr(config, key, value)
        elif isinstance(current, (list, tuple)) and all(isinstance(v, int) for v in current):
            setattr(config, key, type(current)([value] * len(current)))


def _construct(cls: type, config: Any, seed: int) -> nn.Module | None:
    # Some experts classes take their intermediate size as an argument (one per modality).
    for kwargs in ({}, {"intermediate_size": _SHRINK["moe_intermediate_size"]}):
        try:
            torch.manual_seed(seed)
            return cls(config, **kwargs)
        except Exception:  # noqa: BLE001, S112 - try the next way / config class
            continue
    return None


def tiny_experts(model_type: str, seed: int = 0) -> list[nn.Module]:
    """Every experts class of ``model_type``, built from a shrunk default config (E=5, d=16,
    n=10), weights ~ N(0, 0.3²), fp32."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = re.findall(r"@use_experts_implementation[^\n]*\nclass (\w+)\(",
                       Path(module.__file__).read_text())
    built = []
    for name in names:
        cls = getattr(module, name)
        for config in _config_candidates(model_type):
            _shrink(config)
            experts = _construct(cls, config, seed)
            if experts is None:
                continue
            if sum(p.numel() for p in experts.parameters()) > 1_000_000:
                continue
            experts.config._experts_implementation = "eager"
            with torch.no_grad():
                for p in experts.parameters():
                    p.normal_(std=0.3)
            built.append(experts.float())
            break
        else:
            raise RuntimeError(f"could not build a tiny {name} for {model_type}")
    return built
