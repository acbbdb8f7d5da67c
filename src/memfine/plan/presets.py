"""Model shapes for ``memfine plan``: public MoE models and the two reduced models of MemFine.

Each preset holds the sizes the memory model needs (MemFine Table 2 symbols: d, n, E, k, a, h_d,
k_a, V) plus the parameter counts of the parts the model does not derive from them (attention
projections). The MemFine presets also carry the paper's run settings (device memory, dtype,
micro-batch, sequence length, recompute) and a parallel layout of our choosing, so that
``memfine plan --preset memfine-paper-II`` reproduces the setting of MemFine Table 4.

Reference: docs/design.md §4 (MemFine setup), §7 (real configs); the models' published configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from memfine._checks import check_int, lookup
from memfine.config import MoEConfig, ScoreFunc


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSetting:
    """The run a preset comes with: its publisher's layout where published, else our assumption.

    Attributes:
        values: ``(name, value)`` pairs of ``memfine plan`` settings, named as its flags
            (``device_memory`` as a byte-size string, ``dtype``, ``micro_batch``, ``seq_len``,
            ``recompute``, ``static_memory``, ``t``, ``p``, ``e``, ``dp``, ``cp``, ``v``,
            ``grad_bytes``, ``optimizer_bytes``, ``global_batch``); a setting not listed takes
            ``memfine plan``'s default.
        published: the names the publisher states; every other value is assumed.
        note: where the published values come from and what the assumed ones stand for.
    """

    values: tuple[tuple[str, object], ...]
    published: tuple[str, ...] = ()
    note: str

    def get(self, name: str) -> object:
        """The value of setting ``name``, or ``None`` when the setting does not give it."""
        return dict(self.values).get(name)

    def source_of(self, name: str) -> str:
        """``"published"`` or ``"assumed"`` for the setting ``name``."""
        return "published" if name in self.published else "assumed"


def _setting(note: str, published: tuple[str, ...] = (), **values: object) -> RunSetting:
    return RunSetting(values=tuple(values.items()), published=published, note=note)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPreset:
    """Sizes of an MoE transformer, as the memory model uses them.

    Attributes:
        name: preset name.
        hidden_size: d.
        moe_intermediate_size: n, routed-expert width per GLU branch.
        num_experts: E, routed experts per MoE layer.
        top_k: k.
        num_layers: transformer layers L.
        num_dense_layers: leading layers with a dense FFN instead of experts.
        dense_intermediate_size: width of the dense FFN (per GLU branch).
        num_shared_experts: always-on experts per MoE layer.
        shared_intermediate_size: width of one shared expert (per GLU branch).
        num_heads: a, attention (query) heads.
        num_kv_heads: k_a, key/value heads as materialised in the attention (GQA groups; MLA
            materialises one per query head).
        head_dim: h_d.
        attention_params: parameters of one attention block (projections and norms inside it).
        vocab_size: V.
        tied_embeddings: input and output embeddings share one matrix.
        source: where the sizes come from.
        setting: run settings that come with the preset, or ``None``.
        score_func: router scores, as ``MoEConfig.score_func``.
        n_group: expert groups of group-limited routing, as ``MoEConfig.n_group``.
        topk_group: groups per token, as ``MoEConfig.topk_group``.
        routed_scaling_factor: as ``MoEConfig.routed_scaling_factor``.

    The routing fields (and ``num_experts``, ``top_k``, ``num_shared_experts``,
    ``shared_intermediate_size``) carry :class:`memfine.config.MoEConfig`'s field names, so
    :meth:`moe_config` builds the layer ``memfine train`` would use for one MoE layer.
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_layers: int
    num_dense_layers: int
    dense_intermediate_size: int
    num_shared_experts: int
    shared_intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_params: int
    vocab_size: int
    tied_embeddings: bool
    source: str
    setting: RunSetting | None = None
    score_func: ScoreFunc = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        """Check every size (field named in the message, with the value and what is allowed).

        Raises:
            ValueError: a size < 1 (counts < 0), ``top_k`` outside [1, E], no MoE layer left
                (``num_dense_layers`` ≥ ``num_layers``), or a dense/shared width of 0 where
                those layers exist.
        """
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            check_int(self, name, 1)
        check_int(self, "top_k", 1, self.num_experts)
        check_int(self, "num_dense_layers", 0, self.num_layers - 1)
        for name in ("num_shared_experts", "attention_params"):
            check_int(self, name, 0)
        check_int(self, "dense_intermediate_size", 1 if self.num_dense_layers else 0)
        check_int(self, "shared_intermediate_size", 1 if self.num_shared_experts else 0)

    def moe_config(self) -> MoEConfig:
        """One MoE layer of this model as a :class:`MoEConfig` (same field names).

        Raises:
            ValueError: from :class:`MoEConfig` on an inconsistent preset.
        """
        return MoEConfig(hidden_size=self.hidden_size,
                         intermediate_size=self.moe_intermediate_size,
                         num_experts=self.num_experts, top_k=self.top_k,
                         score_func=self.score_func, n_group=self.n_group,
                         topk_group=self.topk_group,
                         routed_scaling_factor=self.routed_scaling_factor,
                         num_shared_experts=self.num_shared_experts,
                         shared_intermediate_size=self.shared_intermediate_size or None)

    @property
    def num_moe_layers(self) -> int:
        """MoE layers: L minus the leading dense layers."""
        return self.num_layers - self.num_dense_layers


def _gqa_params(d: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Q, K, V and output projections of grouped-query attention (no biases)."""
    return 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim


def _gqa(name: str, *, d: int, n: int, E: int, k: int, L: int, heads: int, kv_heads: int, V: int,
         source: str, norm_params: int = 0, head_dim: int = 128,
         setting: RunSetting | None = None) -> ModelPreset:
    """A model of MoE layers only (no dense or shared experts) with grouped-query attention.

    ``norm_params``: parameters of the norms inside the attention block (e.g. q/k norms).
    """
    return ModelPreset(
        name=name, hidden_size=d, moe_intermediate_size=n, num_experts=E, top_k=k,
        num_layers=L, num_dense_layers=0, dense_intermediate_size=0, num_shared_experts=0,
        shared_intermediate_size=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        attention_params=_gqa_params(d, heads, kv_heads, head_dim) + norm_params,
        vocab_size=V, tied_embeddings=False, source=source, setting=setting)


# DeepSeek-V3 multi-head latent attention: q_a (d×1536), q_b (1536×a·192), kv_a (d×(512+64)),
# kv_b (512×a·(128+128)), o (a·128×d), plus the q_a and kv_a norms.
_MLA_PARAMS = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
               + 128 * 128 * 7168 + 1536 + 512)


def _deepseek(name: str, num_layers: int, source: str,
              setting: RunSetting | None = None) -> ModelPreset:
    return ModelPreset(
        name=name, hidden_size=7168, moe_intermediate_size=2048, num_experts=256, top_k=8,
        num_layers=num_layers, num_dense_layers=3, dense_intermediate_size=18432,
        num_shared_experts=1, shared_intermediate_size=2048, num_heads=128, num_kv_heads=128,
        head_dim=128, attention_params=_MLA_PARAMS, vocab_size=129280, tied_embeddings=False,
        source=source, setting=setting, score_func="sigmoid", n_group=8, topk_group=4,
        routed_scaling_factor=2.5)


def _paper_setting(p: int, static_memory: str | None) -> RunSetting:
    return _setting(
        "MemFine §5: 32 devices × 64 GB (read as GiB), bf16, b=1, s=4096, full recompute; "
        "static memory as measured in Table 4 where given; the parallel layout (t, p, e, dp) is "
        "our assumption (not in our notes)",
        ("device_memory", "dtype", "micro_batch", "seq_len", "recompute", "static_memory"),
        device_memory="64GiB", dtype="bfloat16", micro_batch=1, seq_len=4096, recompute="full",
        static_memory=static_memory, t=1, p=p, e=32 // p, dp=32 // p, cp=1)


# What the report runs instead of the assumed values: docs/plan.md. Optimizer bytes: FP32
# master weights 4 + BF16 AdamW moments 2 + 2 = 8.
_DEEPSEEK_V3 = _setting(
    "DeepSeek-V3 technical report §3.2-3.3: 2,048 H800 80 GB, PP 16, EP 64, ZeRO-1 DP, no TP, "
    "s=4096, batch 15,360, BF16 AdamW moments with FP32 master weights and gradients; assumed: "
    "bf16 activations, b=1, full recompute, 1F1B instead of DualPipe",
    ("device_memory", "seq_len", "t", "p", "e", "dp", "cp", "grad_bytes", "optimizer_bytes",
     "global_batch"),
    device_memory="80GiB", seq_len=4096, t=1, p=16, e=64, dp=128, cp=1, grad_bytes=4,
    optimizer_bytes=8, global_batch=15360, dtype="bfloat16", micro_batch=1, recompute="full")


def _assumed(recompute: str, *, t: int, e: int, dp: int, cp: int = 1) -> RunSetting:
    """Nothing published: the best layout ``memfine plan --search`` finds on 80 GiB devices.

    One pipeline stage, global batch 1,024 sequences of 4,096 tokens; every value assumed.
    """
    return _setting(
        "no published training layout in our notes; every value assumed: a layout that fits in "
        f"`memfine plan --search --devices {t * dp * cp} --device-memory 80GiB --global-batch "
        "1024`",
        device_memory="80GiB", recompute=recompute, t=t, p=1, e=e, dp=dp, cp=cp,
        global_batch=1024)


PRESETS: MappingProxyType[str, ModelPreset] = MappingProxyType({
    "deepseek-v3": _deepseek("deepseek-v3", 61, "DeepSeek-V3 config.json (61 layers, 3 dense)",
                             _DEEPSEEK_V3),
    "qwen3-30b-a3b": _gqa("qwen3-30b-a3b", d=2048, n=768, E=128, k=8, L=48, heads=32,
                          kv_heads=4, V=151936, norm_params=2 * 128,
                          source="Qwen3-30B-A3B config.json",
                          setting=_assumed("experts", t=2, e=8, dp=4)),
    "mixtral-8x7b": _gqa("mixtral-8x7b", d=4096, n=14336, E=8, k=2, L=32, heads=32, kv_heads=8,
                         V=32000, source="Mixtral-8x7B config.json",
                         setting=_assumed("none", t=8, e=8, dp=1, cp=2)),
    "olmoe-1b-7b": _gqa("olmoe-1b-7b", d=2048, n=1024, E=64, k=8, L=16, heads=16, kv_heads=16,
                        V=50304, norm_params=2 * 2048, source="OLMoE-1B-7B-0924 config.json",
                        setting=_assumed("none", t=1, e=2, dp=8)),
    "memfine-paper-I": _deepseek(
        "memfine-paper-I", 16, "MemFine Table 3 model I: DeepSeek-V3 cut to 16 layers",
        _paper_setting(p=2, static_memory=None)),
    "memfine-paper-II": _deepseek(
        "memfine-paper-II", 8, "MemFine Table 3 model II: DeepSeek-V3 cut to 8 layers",
        _paper_setting(p=1, static_memory="39.5GiB")),
})


_REQUIRED_SIZES = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "num_layers",
                   "num_heads")


def custom_model(sizes: dict[str, Any]) -> ModelPreset:
    """A model from explicit sizes (``memfine plan``'s size flags).

    GQA attention, no dense or shared layers and a vocabulary of 32,000 unless given.

    Raises:
        ValueError: naming the size flags missing.
    """
    missing = [f for f in _REQUIRED_SIZES if f not in sizes]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        raise ValueError(f"give --preset, --hf-config or the model sizes; missing {flags}")
    d, heads = sizes["hidden_size"], sizes["num_heads"]
    kv = sizes.get("num_kv_heads", heads)
    hd = sizes.get("head_dim", d // heads if heads > 0 else 0)
    full = {"num_dense_layers": 0, "dense_intermediate_size": 0, "num_shared_experts": 0,
            "shared_intermediate_size": 0, "vocab_size": 32000, "num_kv_heads": kv,
            "head_dim": hd, "attention_params": _gqa_params(d, heads, kv, hd), **sizes}
    return ModelPreset(name="custom", tied_embeddings=False, source="explicit sizes", **full)


def get_preset(name: str) -> ModelPreset:
    """Return the preset called ``name``.

    Raises:
        ValueError: on an unknown name (the message lists the presets).
    """
    return lookup(PRESETS, name, "preset")
