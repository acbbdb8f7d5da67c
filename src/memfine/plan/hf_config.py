"""Model sizes from a transformers ``config.json`` (a file or a model directory; no download).

Supported ``model_type`` values: ``qwen3_moe``, ``qwen2_moe``, ``deepseek_v3``, ``mixtral``,
``olmoe``, ``gpt_oss``. Each field of :class:`memfine.plan.presets.ModelPreset` is read from the
key the architecture uses (older spellings accepted: Qwen's ``num_experts`` and transformers 5's
``num_local_experts``; GPT-OSS's ``experts_per_token``). Attention parameters are counted from
the projection shapes (grouped-query attention; DeepSeek-V3's multi-head latent attention from
its LoRA ranks), including q/k norms and biases where the architecture has them.

Not modelled (named in the preset's ``source``): GPT-OSS's expert biases (2n + d per expert) and
attention sinks (a per head), Qwen2-MoE's shared-expert gate (d), DeepSeek-V3's multi-token
prediction module. Each is below 0.1% of the parameters of the published models.

Reference: the architectures' configuration classes in transformers 5 (field names).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memfine.plan.presets import ModelPreset

_ALIASES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token"),
}


class _Reader:
    """Typed access to one config dict; every fault names the file, the key and the value."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data, self.where = data, where

    def int(self, *keys: str, default: int | None = None) -> int:
        """The first of ``keys`` present (an int ≥ 0), else ``default``; ValueError if neither."""
        for key in keys:
            value = self.data.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{self.where}: {key} must be an int >= 0, got {value!r}")
            return value
        if default is None:
            raise ValueError(f"{self.where}: missing field {' or '.join(keys)}")
        return default

    def flag(self, key: str) -> bool:
        """A boolean field (absent: False)."""
        return bool(self.data.get(key, False))


def _leading_dense_layers(r: _Reader, num_layers: int) -> int:
    """Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` as a count of leading dense layers.

    Raises:
        ValueError: when the dense layers are not the first ones (not modelled).
    """
    step = r.int("decoder_sparse_step", default=1)
    only = r.data.get("mlp_only_layers") or []
    if step < 1 or not isinstance(only, list):
        raise ValueError(f"{r.where}: decoder_sparse_step must be >= 1 and mlp_only_layers a "
                         f"list, got {step!r}, {only!r}")
    dense = sorted({i for i in range(num_layers) if i in only or (i + 1) % step})
    if dense != list(range(len(dense))):
        raise ValueError(f"{r.where}: dense layers at {dense}; memfine plan models leading "
                         "dense layers only")
    return len(dense)


def _gqa_attention(r: _Reader, d: int, heads: int, kv: int, hd: int, *, qk_norm: int) -> int:
    """Q, K, V, O projections, their biases and the q/k norm weights.

    ``attention_bias`` puts biases on q, k, v and o; Qwen2's ``qkv_bias`` on q, k and v only.
    """
    biases = 0
    if r.flag("attention_bias") or r.flag("qkv_bias"):
        biases = (heads + 2 * kv) * hd + (d if r.flag("attention_bias") else 0)
    return 2 * d * heads * hd + 2 * d * kv * hd + biases + qk_norm


def _common(r: _Reader, n_key: str) -> dict[str, Any]:
    d, heads = r.int("hidden_size"), r.int("num_attention_heads")
    return {"hidden_size": d, "moe_intermediate_size": r.int(n_key),
            "num_experts": r.int(*_ALIASES["num_experts"]), "top_k": r.int(*_ALIASES["top_k"]),
            "num_layers": r.int("num_hidden_layers"), "num_heads": heads,
            "num_kv_heads": r.int("num_key_value_heads", default=heads),
            "head_dim": r.int("head_dim", default=d // heads if heads else 0),
            "vocab_size": r.int("vocab_size")}


def _qwen(r: _Reader, *, shared: bool) -> dict[str, Any]:
    out = _common(r, "moe_intermediate_size")
    d, heads, kv, hd = (out[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"))
    out["num_dense_layers"] = _leading_dense_layers(r, out["num_layers"])
    out["dense_intermediate_size"] = r.int("intermediate_size") if out["num_dense_layers"] else 0
    width = r.int("shared_expert_intermediate_size", default=0) if shared else 0
    out.update(num_shared_experts=1 if width else 0, shared_intermediate_size=width)
    out["attention_params"] = _gqa_attention(  # Qwen3 normalises q and k per head
        r, d, heads, kv, hd, qk_norm=0 if shared else 2 * hd)
    return out


def _deepseek_v3(r: _Reader) -> dict[str, Any]:
    out = _common(r, "moe_intermediate_size")
    d, a = out["hidden_size"], out["num_heads"]
    nope, rope, v = r.int("qk_nope_head_dim"), r.int("qk_rope_head_dim"), r.int("v_head_dim")
    q_lora, kv_lora = r.int("q_lora_rank", default=0), r.int("kv_lora_rank")
    q = d * q_lora + q_lora + q_lora * a * (nope + rope) if q_lora else d * a * (nope + rope)
    out.update(
        head_dim=v, num_kv_heads=a,  # MLA materialises K and V per query head
        num_dense_layers=r.int("first_k_dense_replace", default=0),
        dense_intermediate_size=r.int("intermediate_size"),
        num_shared_experts=r.int("n_shared_experts", default=0),
        shared_intermediate_size=out["moe_intermediate_size"],
        attention_params=q + d * (kv_lora + rope) + kv_lora + kv_lora * a * (nope + v)
        + a * v * d)
    if r.int("moe_layer_freq", default=1) != 1:
        raise ValueError(f"{r.where}: moe_layer_freq must be 1 (every layer after the dense "
                         f"ones is MoE), got {r.data['moe_layer_freq']!r}")
    scale = r.data.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{r.where}: routed_scaling_factor must be a number, got {scale!r}")
    # DeepSeek-V3 routing (sigmoid scores, group-limited), under MoEConfig's field names
    out.update(score_func="sigmoid", n_group=r.int("n_group", default=1),
               topk_group=r.int("topk_group", default=1), routed_scaling_factor=float(scale))
    return out


def _no_dense(r: _Reader, *, qk_norm: int) -> dict[str, Any]:
    out = _common(r, "intermediate_size")
    out.update(num_dense_layers=0, dense_intermediate_size=0, num_shared_experts=0,
               shared_intermediate_size=0)
    out["attention_params"] = _gqa_attention(r, out["hidden_size"], out["num_heads"],
                                             out["num_kv_heads"], out["head_dim"],
                                             qk_norm=qk_norm)
    return out


def _olmoe(r: _Reader) -> dict[str, Any]:
    out = _no_dense(r, qk_norm=0)  # OLMoE normalises q and k over their whole widths
    out["attention_params"] += out["hidden_size"] + out["num_kv_heads"] * out["head_dim"]
    return out


PARSERS: dict[str, Callable[[_Reader], dict[str, Any]]] = {
    "qwen3_moe": lambda r: _qwen(r, shared=False),
    "qwen2_moe": lambda r: _qwen(r, shared=True),
    "deepseek_v3": _deepseek_v3,
    "mixtral": lambda r: _no_dense(r, qk_norm=0),
    "olmoe": _olmoe,
    "gpt_oss": lambda r: _no_dense(r, qk_norm=0),
}
"""``model_type`` → the reader of its fields (the supported architectures)."""


def model_from_hf_config(data: Mapping[str, Any], *, name: str, where: str) -> ModelPreset:
    """The :class:`ModelPreset` of a parsed ``config.json``.

    Args:
        data: the JSON object.
        name: the preset name to give it (e.g. the model directory's name).
        where: the file, for messages and the preset's ``source``.

    Returns:
        The model sizes (no run setting: layouts come from flags or ``--search``).

    Raises:
        ValueError: on an unsupported ``model_type`` (the message lists the supported ones), a
            missing or mistyped field (named), or sizes the model rejects.
    """
    model_type = data.get("model_type")
    if model_type not in PARSERS:
        raise ValueError(f"{where}: model_type must be one of {sorted(PARSERS)}, got "
                         f"{model_type!r}")
    fields = PARSERS[model_type](_Reader(data, where))
    return ModelPreset(name=name, tied_embeddings=bool(data.get("tie_word_embeddings", False)),
                       source=f"{where} (model_type {model_type})", **fields)


def load_hf_config(path: str | Path) -> ModelPreset:
    """Read ``path`` (a ``config.json`` or a directory holding one) into a :class:`ModelPreset`.

    Raises:
        ValueError: when the file is missing, unreadable or not a JSON object, or as
            :func:`model_from_hf_config`.
    """
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    if file.exists() and not file.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"--hf-config: {str(file)!r} is not a regular file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--hf-config: no such file {str(file)!r}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--hf-config: cannot read {str(file)!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--hf-config: {str(file)!r} is not JSON ({err.msg}, line "
                         f"{err.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--hf-config: {str(file)!r} must hold a JSON object, got "
                         f"{type(data).__name__}")
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return model_from_hf_config(data, name=name, where=str(file))
