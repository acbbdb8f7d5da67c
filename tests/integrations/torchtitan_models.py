"""Tiny torchtitan MoE models (qwen3, deepseek_v3, gpt_oss), built by each model's own layer
builder, so router, shared experts and routed scaling are exactly those of the model.

Sizes follow each model's ``debugmodel`` flavour, scaled down to run in a second on a CPU:
qwen3 (softmax, route_norm, no shared experts), deepseek_v3 (softmax, 2 shared experts, one dense
layer first; the ``sigmoid_scaled`` variant adds DeepSeek-V3's sigmoid scores, renormalisation and
route_scale 2.5), gpt_oss (biases, clamped interleaved SwiGLU).
Also used by ``benchmarks/bench_torchtitan.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MODELS = ("qwen3", "deepseek_v3", "deepseek_v3_sigmoid_scaled", "gpt_oss")


def _qwen3(dim: int, hidden: int, num_experts: int, top_k: int, n_layers: int,
           vocab: int) -> Any:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    head_dim = 16
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2,
            head_dim=head_dim, moe_hidden_dim=hidden, num_experts=num_experts, top_k=top_k,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1000000.0)))


def _deepseek_v3(dim: int, hidden: int, num_experts: int, top_k: int, n_layers: int,
                 vocab: int, *, sigmoid_scaled: bool = False) -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    rope_dim = 8
    router = (dict(router_score_func="sigmoid", router_route_norm=True, router_route_scale=2.5)
              if sigmoid_scaled else dict(router_score_func="softmax"))
    layers = _build_dsv3_layers(
        n_layers=n_layers + 1, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16,
        mscale=0.70, dense_hidden_dim=2 * dim, moe_hidden_dim=hidden,
        num_experts=num_experts, num_shared_experts=2, router_top_k=top_k,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=256, theta=10000.0), **router)
    return DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab), layers=layers)


def _gpt_oss(dim: int, hidden: int, num_experts: int, top_k: int, n_layers: int,
             vocab: int) -> Any:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.gpt_oss import GptOssModel, _build_gptoss_layers

    return GptOssModel.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_gptoss_layers(
            fuse_qkv=True, dim=dim, n_layers=n_layers, hidden_dim=hidden,
            num_experts=num_experts, top_k=top_k, load_balance_coeff=1e-3, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=64, max_seq_len=256, theta=150000.0)))  # head_dim 64


def _causal_sdpa(config: Any) -> Any:
    """Swap flex attention (no backward on CPU in torch 2.13) for torchtitan's causal SDPA."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def model_config(name: str, *, dim: int = 32, hidden: int = 16, num_experts: int = 6,
                 top_k: int = 2, n_layers: int = 1, vocab: int = 64) -> Any:
    """The model's config at the given sizes (n_layers MoE layers), causal SDPA attention."""
    if name == "qwen3":
        config = _qwen3(dim, hidden, num_experts, top_k, n_layers, vocab)
    elif name.startswith("deepseek_v3"):
        config = _deepseek_v3(dim, hidden, num_experts, top_k, n_layers, vocab,
                              sigmoid_scaled=name.endswith("sigmoid_scaled"))
    elif name == "gpt_oss":
        config = _gpt_oss(dim, hidden, num_experts, top_k, n_layers, vocab)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return _causal_sdpa(config)


def build_model(config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """Build and initialise a model from its config (CPU, deterministic weights).

    Only parameters are cast to ``dtype`` (buffers such as DeepSeek-V3's complex RoPE cache keep
    theirs), as FSDP's mixed precision does.
    """
    torch.manual_seed(seed)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def moe_modules(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks, in order."""
    from torchtitan.models.common.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def forward_tokens(model: nn.Module, tokens_BQ: torch.Tensor) -> torch.Tensor:
    """Logits (b, s, V) of a torchtitan decoder (positions 0..s-1, causal attention)."""
    B, Q = tokens_BQ.shape
    return model(tokens_BQ, torch.arange(Q).expand(B, Q))


def build_moe(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
              **sizes: Any) -> nn.Module:
    """The last MoE block of the model at these sizes, weights ~ N(0, 1/fan_in) so that
    outputs and gradients are O(1) for O(1) inputs."""
    config = model_config(name, **sizes)
    torch.manual_seed(seed)
    moe = config.layers[-1].moe.build()
    moe.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        for param in moe.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.normal_(0.0, 0.1)
            param.data = param.data.to(dtype)
    return moe


def routed_saved_bytes(moe: nn.Module, x_BLD: torch.Tensor) -> int:
    """Bytes saved for backward by the MoE block's routed-experts part alone (the router runs
    before tracking, so its own saved tensors are not counted)."""
    from memfine.measure.saved import track_saved_tensors

    scores, ids, _ = moe.router(x_BLD, moe.expert_bias_E)
    counts = torch.bincount(ids.flatten(), minlength=moe.router.num_experts)
    with track_saved_tensors() as saved:
        moe.routed_experts(x_BLD, scores, ids, counts)
    return saved.total_bytes
