"""torchtitan classes of the integration (this module imports torchtitan; load it lazily).

- :class:`MemfineRoutedExperts`: torchtitan's ``RoutedExperts`` (the routed-experts part of
  ``torchtitan.models.common.moe.MoE``: token dispatcher + ``GroupedExperts``) running memfine's
  experts. Its children are torchtitan's own (``inner_experts`` holds the parameters), so
  parameter names, shapes, layouts, state dicts, state-dict adapters and FSDP wrapping are
  unchanged; only the computation differs.
- :class:`MemfineExpertsConverter`: a torchtitan ``ModelConfigConverter`` that swaps every
  ``RoutedExperts.Config`` of a model config for :class:`MemfineRoutedExperts.Config` (the way
  torchtitan's low-precision converters swap ``GroupedExperts.Config``).
- :func:`memfine_experts`: the same swap as a torchtitan override, so that
  ``--override.imports`` turns memfine on, with options, from torchtitan's command line.

Legend: B batch, L sequence, T tokens, K top-k slots, R rows a dispatcher delivers to this
rank's experts, E experts (E_local under expert parallelism), D = d, N = n, G = 2n.
Reference: MoEBlaze §3-§5 (buffer-free dispatch, fused experts); MemFine §4, Eq. 8-9 (chunks,
MACT); docs/torchtitan.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu
from torchtitan.protocols.model import ModelConfigConverter

from memfine.config import GatedActivation
from memfine.experts import compute_element_size
from memfine.hf.experts import chunk_policy as experts_policy
from memfine.hf.experts import last_decision, num_chunks_for, run_module
from memfine.hf.layout import ExpertsPlan, ExpertWeights
from memfine.integrations.torchtitan import TorchtitanExpertsConfig
from memfine.integrations.torchtitan_budget import (
    BUDGET_ATTRIBUTE,
    budget_chunk_config,
    experts_budget,
)
from memfine.integrations.torchtitan_checkpoint import outside_selective_checkpoint
from memfine.schedule import ChunkDecision

_log = logging.getLogger(__name__)


class _Gate:
    """The gate of the plain path (``_apply_gate`` on H, as the shared expert runner calls it)."""

    has_gate = True

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def _apply_gate(self, h_SG: torch.Tensor) -> torch.Tensor:
        return self._fn(h_SG)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor weight (as torchtitan's GroupedExperts reads it), else it.

    Inside torchtitan's ``local_map`` region the routed experts compute on local shards: the
    experts this rank holds under expert parallelism, a slice of n under expert tensor
    parallelism (SwiGLU is elementwise over n, so the partial outputs sum to the full one).
    """
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _tp_degree(weight: torch.Tensor) -> int:
    """Size of the ``tp`` mesh dimension of a DTensor weight (1 otherwise)."""
    if not isinstance(weight, DTensor):
        return 1
    names = weight.device_mesh.mesh_dim_names or ()
    return weight.device_mesh.size(names.index("tp")) if "tp" in names else 1


def _silu_gate(h_SG: torch.Tensor) -> torch.Tensor:
    """SwiGLU of torchtitan's GroupedExperts: SiLU(x·w1) ⊙ (x·w3) on H = [x·w1 | x·w3]."""
    gate_SN, up_SN = h_SG.chunk(2, dim=-1)
    return F.silu(gate_SN) * up_SN


def experts_layout(inner: nn.Module, impl: str) -> tuple[ExpertWeights, ExpertsPlan, _Gate]:
    """How memfine reads a torchtitan experts module: weight views, path and plain-path gate.

    - ``GroupedExperts`` (qwen3, deepseek_v3, ...): w1 (E, n, d) gate, w3 (E, n, d) up,
      w2 (E, d, n) down → the two up halves kept apart (no concatenated copy) and the fused
      SwiGLU path.
    - ``GptOssGroupedExperts``: ``mlp1_weight`` (E, 2n, d) with interleaved gate/up columns and
      a bias, GPT-OSS's clamped SwiGLU (α = 1.702, ``swiglu_limit``, +1 on the up half, as
      torchtitan's ``swiglu``), ``mlp2`` with a bias → the fused path with
      ``GatedActivation.gpt_oss`` and both biases; ``impl="plain"`` calls torchtitan's own
      ``swiglu`` on the routed rows instead.

    Raises:
        ValueError: for another experts class, or GPT-OSS experts under tensor parallelism.
    """
    if type(inner) is GroupedExperts:
        weights = ExpertWeights(
            w_up_EDG=_local(inner.w1_EFD).transpose(1, 2),
            w_up_second_EDN=_local(inner.w3_EFD).transpose(1, 2),
            w_down_END=_local(inner.w2_EDF).transpose(1, 2), b_up_EG=None, b_down_ED=None)
        plan = ExpertsPlan(path="fused", activation="swiglu")
        if impl == "plain":
            plan = ExpertsPlan(path="plain", activation=None, reason="impl='plain'")
        return weights, plan, _Gate(_silu_gate)
    if type(inner) is GptOssGroupedExperts:
        if _tp_degree(inner.mlp1_weight_EGD) > 1:
            raise ValueError("memfine does not run GptOssGroupedExperts under tensor parallelism "
                             "(torchtitan scales its down bias by 1/tp there)")
        weights = ExpertWeights(
            w_up_EDG=_local(inner.mlp1_weight_EGD).transpose(1, 2),
            w_down_END=_local(inner.mlp2_weight_EDF).transpose(1, 2),
            b_up_EG=_local(inner.mlp1_bias_EG), b_down_ED=_local(inner.mlp2_bias_ED))
        limit = inner.swiglu_limit
        plan = ExpertsPlan(path="fused", activation=GatedActivation.gpt_oss(limit=limit))
        if impl == "plain":
            plan = ExpertsPlan(path="plain", activation=None, reason="impl='plain'")
        return weights, plan, _Gate(lambda h_SG: swiglu(h_SG, limit=limit))
    raise ValueError(unsupported_experts_message(type(inner).__name__))


# Prefix of the experts subclasses torchtitan's quantisation converters build → the converter.
_QUANTISED = {"Float8": "Float8GroupedExpertsConverter", "MXFP8": "MXFP8GroupedExpertsConverter"}


def unsupported_experts_message(name: str) -> str:
    """One line on an experts class memfine does not run; quantised ones name their converter.

    torchtitan's ``Float8GroupedExpertsConverter`` / ``MXFP8GroupedExpertsConverter`` build
    ``Float8GroupedExperts`` / ``MXFP8GroupedExperts`` (subclasses keeping the parameter layout
    whose grouped GEMMs quantise on the fly). memfine computes its experts in the parameters'
    dtype and has no quantised grouped GEMM, so running them would silently drop the
    quantisation: they are refused and the message names the converter to drop.
    """
    for prefix, converter in _QUANTISED.items():
        if name.startswith(prefix):
            return (f"memfine's experts do not run torchtitan's quantised {name} (memfine computes "
                    f"in the parameters' dtype): drop {converter} from the model's converters, "
                    f"or drop memfine's converter")
    return f"memfine supports torchtitan's GroupedExperts and GptOssGroupedExperts, got {name}"


def _is_local(dispatcher: object) -> bool:
    """True when the dispatcher only reorders tokens on this rank (no expert parallelism)."""
    if type(dispatcher) is LocalTokenDispatcher:
        return True
    return type(dispatcher) is AllToAllTokenDispatcher and dispatcher.ep_mesh is None


class MemfineRoutedExperts(RoutedExperts):
    """torchtitan's routed-experts part running memfine's experts; same children and parameters.

    ``forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)`` is
    torchtitan's signature: the router's top-k scores (already normalised and scaled by the
    router's ``route_scale``) and ids are reused as they are, never recomputed.

    Dispatch (``TorchtitanExpertsConfig.dispatch``):
        - ``memfine`` (``auto`` without expert parallelism): torchtitan's dispatcher is not
          called. memfine builds its routing index from the ids and runs the fused experts on
          x directly (MoEBlaze buffer-free dispatch), over c token chunks.
        - ``torchtitan`` (``auto`` under expert parallelism): torchtitan's dispatcher moves the
          rows (its all-to-all), memfine runs the experts on the R received rows (grouped by
          local expert, each row with weight 1, c chunks over rows: MemFine's s″), and the
          dispatcher's ``combine`` applies the scores and returns rows.

    Memory (saved for backward, dispatch ``memfine``, no chunks, fused path): x (T·d), H
    (T·k·2n), the scores (T·k) and int32 indices, as :class:`memfine.experts.FusedExpertsFunction`;
    with chunks and recompute, x and the routing tensors only. torchtitan's own path saves the
    permuted copy of x, the bf16 casts and the products of each grouped GEMM, and the routed
    output for the combine.

    Precision: memfine computes in the parameters' dtype (fp32 parameters → fp32 GEMMs);
    torchtitan's ``GroupedExperts`` casts to bf16 for its grouped GEMMs.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        """``RoutedExperts.Config`` plus memfine's options (``memfine``)."""

        memfine: TorchtitanExpertsConfig = field(default_factory=TorchtitanExpertsConfig)

    def __init__(self, config: Config) -> None:
        """Build torchtitan's children from ``config`` and keep memfine's options."""
        super().__init__(config)
        self.memfine_config = config.memfine

    @classmethod
    def convert(cls, module: RoutedExperts, config: TorchtitanExpertsConfig) -> None:
        """Turn a built ``RoutedExperts`` into this class in place (children, params, hooks kept).

        Raises:
            ValueError: if ``module`` is not exactly a ``RoutedExperts`` or its experts class is
                not supported.
        """
        if type(module) is not RoutedExperts:
            raise ValueError(f"expected torchtitan's RoutedExperts, got {type(module).__name__}")
        experts_layout(module.inner_experts, config.impl)  # raises on unsupported experts
        module.__class__ = cls
        cast(MemfineRoutedExperts, module).memfine_config = config  # its class is now cls

    def _uses_memfine_dispatch(self) -> bool:
        mode, local = self.memfine_config.dispatch, _is_local(self.token_dispatcher)
        if mode == "memfine" and not local:
            raise ValueError(f"TorchtitanExpertsConfig.dispatch='memfine' replaces torchtitan's "
                             f"local dispatch only, but {type(self.token_dispatcher).__name__} "
                             f"has an expert-parallel mesh; use dispatch='auto' or 'torchtitan'")
        return mode == "memfine" or (mode == "auto" and local)

    def _experts(self, x_TD: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, rows: int) -> torch.Tensor:
        """(T, d) routed output in x's dtype, computed in the parameters' dtype (rows: s″)."""
        cfg = self.memfine_config
        weights, plan, gate = experts_layout(self.inner_experts, cfg.impl)
        if not getattr(self, "_memfine_logged", False):
            _log.info("memfine experts in %s: %s path%s", type(self.inner_experts).__name__,
                      plan.path, f" ({plan.reason})" if plan.reason else "")
            self._memfine_logged = True
        gate = self.__dict__.setdefault("_memfine_gate", gate)  # keeps the chunk policy cache
        x_cast_TD = x_TD.to(weights.w_up_EDG.dtype)
        self._note_chunking(gate, plan, weights, x_cast_TD, top_k_index, rows)
        out_TD = run_module(gate, plan, weights, x_cast_TD, top_k_index, top_k_weights,
                            chunk=cfg.chunk, backend=cfg.gemm_backend,
                            index_builder=cfg.index_builder)
        return out_TD.to(x_TD.dtype)

    def _note_chunking(self, gate: _Gate, plan: ExpertsPlan, weights: ExpertWeights,
                       x_TD: torch.Tensor, top_k_index: torch.Tensor, rows: int) -> None:
        """Keep this call's memory model (``memfine_budget``, logged at the first call).

        The model is that of a budget with this block's bins and recompute mode (its own
        budget, when set: then it is the block's own chunk policy). The chunk decision is the
        policy's record (:attr:`last_decision`): ``run_module`` makes it when it chunks; an
        unchunked call (c = 1 without a budget: one direct call, no recompute) has it made here
        by the policy of that call.
        """
        chunk = self.memfine_config.chunk
        budgeted = chunk.memory_budget_bytes is not None
        holder = gate if budgeted else self.__dict__.setdefault("_memfine_budget_policy",
                                                                SimpleNamespace())
        policy = experts_policy(holder, plan, weights, top_k_index.shape[1],
                                budget_chunk_config(chunk))
        budget = experts_budget(policy, top_k_index.shape[0], rows, compute_element_size(x_TD),
                                device_type=x_TD.device.type)
        if getattr(self, BUDGET_ATTRIBUTE, None) is None:
            _log.info("memfine experts memory model at the first step: %s", budget.describe())
        setattr(self, BUDGET_ATTRIBUTE, budget)
        if not budgeted and chunk.num_chunks == 1:
            num_chunks_for(gate, plan, weights, x_TD, top_k_index,
                           replace(chunk, recompute="none"))

    @property
    def last_decision(self) -> ChunkDecision | None:
        """The :class:`ChunkDecision` of the last call (c, recompute, prediction), or None.

        Under ``torch.compile`` a fixed chunk count is not recorded (as
        :meth:`memfine.schedule.ChunkPolicy.num_chunks`).
        """
        gate = self.__dict__.get("_memfine_gate")
        return None if gate is None else last_decision(gate)

    def _experts_behind_dispatcher(self, x_TD: torch.Tensor, scores_TK: torch.Tensor,
                                   ids_TK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Run torchtitan's dispatch and combine around memfine's experts on the received rows."""
        routed_RD, counts_e, metadata = self.token_dispatcher.dispatch(x_TD, scores_TK, ids_TK,
                                                                       counts_E)
        E_local, R = counts_e.shape[0], routed_RD.shape[0]
        num_rows = int(counts_e.sum())
        ids_R1 = torch.full((R, 1), E_local, dtype=torch.int64, device=routed_RD.device)
        ids_R1[:num_rows, 0] = torch.repeat_interleave(
            torch.arange(E_local, device=routed_RD.device), counts_e.long(),
            output_size=num_rows)  # rows past the counts (padding) get the sentinel E_local
        ones_R1 = routed_RD.new_ones(R, 1)
        with outside_selective_checkpoint():  # SAC would keep the fused experts' GEMMs
            out_RD = self._experts(routed_RD, ids_R1, ones_R1, num_rows)
        return self.token_dispatcher.combine(out_RD, metadata, x_TD)

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Routed output (B, L, d) in x's dtype: Σ_j score_tj · expert_{id_tj}(x_t).

        Args:
            x_BLD: (B, L, d) layer input.
            topk_scores_BLK: (B, L, k) router scores (float32 from torchtitan's router).
            topk_expert_ids_BLK: (B, L, k) int64 expert ids.
            num_local_tokens_per_expert_E: (E,) tokens per expert on this rank.

        Raises:
            ValueError: if ``dispatch='memfine'`` meets an expert-parallel dispatcher.
        """
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        x_TD = x_BLD.reshape(B * L, D)
        scores_TK = topk_scores_BLK.reshape(B * L, K)
        ids_TK = topk_expert_ids_BLK.reshape(B * L, K)
        if self._uses_memfine_dispatch():
            with outside_selective_checkpoint():  # SAC would keep the fused experts' GEMMs
                out_TD = self._experts(x_TD, ids_TK, scores_TK, ids_TK.numel())
        else:
            out_TD = self._experts_behind_dispatcher(x_TD, scores_TK, ids_TK,
                                                     num_local_tokens_per_expert_E)
        return out_TD.view(B, -1, D)


def memfine_routed_experts_config(config: RoutedExperts.Config,
                                  options: TorchtitanExpertsConfig) -> Any:
    """``MemfineRoutedExperts.Config`` with every field of a ``RoutedExperts.Config``."""
    return MemfineRoutedExperts.Config(
        **{f.name: getattr(config, f.name) for f in fields(config)}, memfine=options)


class MemfineExpertsConverter(ModelConfigConverter):
    """torchtitan model converter: memfine's experts in every MoE block of a model config.

    Usage (``converters=`` of a model registry, e.g. torchtitan's ``qwen3.model_registry``)::

        from memfine.integrations.torchtitan import converter
        spec = model_registry("debugmodel_moe", converters=[converter(num_chunks=4)])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        """The memfine options applied to every routed-experts block."""

        experts: TorchtitanExpertsConfig = field(default_factory=TorchtitanExpertsConfig)

    def __init__(self, config: Config) -> None:
        """Keep the options."""
        self.config = config

    @staticmethod
    def check_experts(experts_config: Any) -> None:
        """Raise unless memfine runs the experts this config builds.

        Raises:
            ValueError: for quantised experts (naming the converter to drop) or another class.
        """
        if type(experts_config) not in (GroupedExperts.Config, GptOssGroupedExperts.Config):
            owner = getattr(type(experts_config), "_owner", type(experts_config))
            raise ValueError(unsupported_experts_message(owner.__name__))

    def convert(self, model_config: Any) -> Any:
        """Swap every ``RoutedExperts.Config`` (and only that exact class) in the tree.

        Raises:
            ValueError: when the config has no ``RoutedExperts.Config``, or one of its experts
                is not supported (quantised experts: the message names the converter to drop).
        """
        swapped = []
        for fqn, cfg, parent, attr in list(model_config.traverse(RoutedExperts.Config)):
            if type(cfg) is not RoutedExperts.Config:
                continue
            self.check_experts(cfg.inner_experts)
            new = memfine_routed_experts_config(cfg, self.config.experts)
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            swapped.append(fqn)
        if not swapped:
            raise ValueError(f"{type(model_config).__name__} has no RoutedExperts.Config to "
                             f"convert (not a torchtitan MoE model?)")
        _log.info("memfine experts in %d MoE blocks: %s", len(swapped), ", ".join(swapped))
        return model_config


@override(target=RoutedExperts.Config,
          description="memfine experts: buffer-free fused experts and MemFine chunking")
def memfine_experts(cfg: RoutedExperts.Config, **options: Any) -> MemfineRoutedExperts.Config:
    """Torchtitan override: every routed-experts block runs memfine's experts with ``options``.

    Activated on torchtitan's command line with ``--override.imports
    'memfine.integrations.torchtitan_modules.memfine_experts={"num_chunks": 2}'`` (keyword
    arguments of :func:`memfine.integrations.torchtitan.make_options`, as a JSON object). It
    replaces ``RoutedExperts.Config`` and ``MemfineRoutedExperts.Config`` alike, so it also sets
    the options of a config function of :mod:`memfine.integrations.torchtitan_configs`.

    Raises:
        ValueError: on invalid options, or experts memfine does not run (quantised experts: the
            message names the converter to drop).
    """
    from memfine.integrations.torchtitan import make_options

    MemfineExpertsConverter.check_experts(cfg.inner_experts)
    return derive(cfg, MemfineRoutedExperts.Config, memfine=make_options(**options))
