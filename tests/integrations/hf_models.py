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

import pytest
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

    The six families of :data:`CAUSAL_LMS` have hand-written configs; any other architecture is
    built by :func:`generic_causal_lm` (a ValueError says why when it cannot be).

    Expert weights are re-drawn with std 0.3 so that the experts' contribution to the logits is
    not negligible next to the residual stream.
    """
    transformers = importlib.import_module("transformers")
    if model_type in CAUSAL_LMS:
        config_name, model_name, kwargs = CAUSAL_LMS[model_type]
        model_family(model_type, "modeling")
        config = getattr(transformers, config_name)(**COMMON, **kwargs)
    else:
        entry, why = generic_causal_lm(model_type)
        if entry is None:
            raise ValueError(f"model_type {model_type!r} has no generic tiny causal LM: {why}")
        config_name, _, model_name, kwargs = entry
        config = getattr(transformers, config_name)(**kwargs)
        config.use_cache = False
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
    module = model_family(model_type, "configuration")
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


def model_family(model_type: str, part: str) -> Any:
    """``transformers.models.<model_type>.<part>_<model_type>``; the calling test skips, with the
    reason, where the installed transformers predates the family."""
    try:
        return importlib.import_module(f"transformers.models.{model_type}.{part}_{model_type}")
    except ModuleNotFoundError as err:
        if err.name is None or not f"transformers.models.{model_type}".startswith(err.name):
            raise
        version = importlib.import_module("transformers").__version__
        pytest.skip(f"transformers {version} has no model family {model_type!r} (a later "
                    "release adds it)")


def tiny_experts(model_type: str, seed: int = 0) -> list[nn.Module]:
    """Every experts class of ``model_type``, built from a shrunk default config (E=5, d=16,
    n=10), weights ~ N(0, 0.3²), fp32."""
    module = model_family(model_type, "modeling")
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


# Whole causal LMs of every architecture, shrunk generically from the default config (used by
# tests/integrations/test_transformers_loading.py and by scripts/run_hf_model_tests.sh, which
# copies this file next to transformers' test mixins).
_LM_SHRINK = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=40, moe_intermediate_size=N_ODD, expert_intermediate_size=N_ODD,
    num_experts=6, num_local_experts=6, n_routed_experts=6, num_experts_per_tok=2,
    max_position_embeddings=64, vocab_size=61, shared_expert_intermediate_size=24,
    moe_shared_expert_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    n_group=2, topk_group=1, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, index_n_heads=2, index_head_dim=8)
MAX_LM_PARAMETERS = 3_000_000


def _shrink_lm(config: Any) -> None:
    for key, value in _LM_SHRINK.items():
        current = getattr(config, key, "absent")
        if current == "absent":
            continue
        if isinstance(current, (list, tuple)) and current and all(
                isinstance(v, int) for v in current):
            value = type(current)([value] * len(current))
        setattr(config, key, value)
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(getattr(config, key, None), (int, list)):  # ids inside the vocabulary
            setattr(config, key, token)
    if getattr(config, "mlp_only_layers", None):  # layers of dense MLPs only: keep both MoE
        config.mlp_only_layers = []
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention: kv heads = heads
        config.num_key_value_heads = config.num_attention_heads
    for key in [k for k in vars(config) if k.endswith("layer_types")]:
        layer_types = getattr(config, key)
        if isinstance(layer_types, (list, tuple)) and len(layer_types) != 2:
            kinds = list(dict.fromkeys(layer_types))
            setattr(config, key, (kinds + kinds)[:2])


def generic_causal_lm(model_type: str) -> tuple[tuple[str, str, str, dict[str, Any]] | None, str]:
    """How to build a tiny causal LM of ``model_type`` from its shrunk default config.

    The default config is shrunk (d 32, 2 layers, E 6, k 2, n 30, vocabulary 61) and rebuilt from
    its non-default keys (so the config class validates it); the model must have under
    ``MAX_LM_PARAMETERS`` parameters, at least one experts module, and run a forward pass with
    eager experts.

    Returns:
        ``((config class, base model class, causal LM class, config kwargs), "")``, or
        ``(None, why)`` for an architecture the generic shrink cannot build (multimodal models
        without a text causal LM class, hybrid layouts the shrink breaks, ...).
    """
    transformers = importlib.import_module("transformers")
    names = importlib.import_module("transformers.models.auto.modeling_auto")
    causal = names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    base = causal.replace("ForCausalLM", "Model") if causal else None
    if causal is None or not hasattr(transformers, base):
        return None, "no text causal LM class (multimodal or experts-only)"
    try:
        cls = getattr(transformers, causal)
        shrunk = cls.config_class()
        _shrink_lm(shrunk)
        keys = {k: v for k, v in shrunk.to_diff_dict().items() if not k.startswith("_")
                and k not in ("model_type", "transformers_version", "architectures", "dtype")}
        config = cls.config_class(**keys)  # the config the tests build, validated
        config._experts_implementation = "eager"
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
        if size > MAX_LM_PARAMETERS:
            return None, f"the shrunk default config still has {size} parameters"
        model = cls(config).eval()
        if not experts_modules(model):
            return None, "the shrunk config has no MoE layer"
        with torch.no_grad():
            model(input_ids=torch.randint(3, 61, (2, 5)))
    except Exception as err:  # noqa: BLE001 - an architecture the generic shrink cannot build
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return (config.__class__.__name__, base, causal, keys), ""
