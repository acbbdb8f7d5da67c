"""Config validation: every field's check, exact ValueError messages, round trips, immutability."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import get_args

import pytest

from memfine.config import (
    ChunkConfig,
    ModelConfig,
    MoEConfig,
    RouteOptions,
    ScoreFunc,
    TrainConfig,
)

Config = RouteOptions | MoEConfig | ChunkConfig | ModelConfig | TrainConfig
MOE = {"hidden_size": 16, "intermediate_size": 32, "num_experts": 8, "top_k": 2}


def _moe(**overrides: object) -> MoEConfig:
    return MoEConfig(**{**MOE, **overrides})


def _model(**overrides: object) -> ModelConfig:
    return ModelConfig(**{"moe": _moe(), "num_heads": 2, **overrides})


def _pattern(message: str) -> str:
    return "^" + re.escape(message) + "$"


BAD_MOE = [
    pytest.param({"hidden_size": 0}, "MoEConfig.hidden_size must be >= 1, got 0", id="hidden_0"),
    pytest.param({"hidden_size": 1.5}, "MoEConfig.hidden_size must be an int, got 1.5",
                 id="hidden_float"),
    pytest.param({"hidden_size": True}, "MoEConfig.hidden_size must be an int, got True",
                 id="hidden_bool"),
    pytest.param({"intermediate_size": -3}, "MoEConfig.intermediate_size must be >= 1, got -3",
                 id="intermediate_negative"),
    pytest.param({"num_experts": 0}, "MoEConfig.num_experts must be >= 1, got 0",
                 id="experts_0"),
    pytest.param({"top_k": 9}, "MoEConfig.top_k must be in [1, num_experts=8], got 9",
                 id="top_k_gt_E"),
    pytest.param({"top_k": 0}, "MoEConfig.top_k must be >= 1, got 0", id="top_k_0"),
    pytest.param({"top_k": "2"}, "MoEConfig.top_k must be an int, got '2'", id="top_k_str"),
    pytest.param({"score_func": "tanh"},  # the names come from the one score-function table
                 f"MoEConfig.score_func must be one of {get_args(ScoreFunc)}, got 'tanh'",
                 id="score_func"),
    pytest.param({"activation": "swish"},
                 "MoEConfig.activation must be one of ('swiglu', 'geglu', 'gelu', 'relu', 'relu2', "
                 "'silu'), got 'swish'", id="activation"),
    pytest.param({"experts_impl": "megablocks"},
                 "MoEConfig.experts_impl must be one of ('fused', 'plain'), got 'megablocks'",
                 id="experts_impl"),
    pytest.param({"gemm_backend": "cuda"},
                 "MoEConfig.gemm_backend must be one of ('auto', 'grouped_mm', 'loop', "
                 "'triton'), got 'cuda'", id="gemm_backend"),
    pytest.param({"index_builder": "radix"},
                 "MoEConfig.index_builder must be one of ('auto', 'sort_free', 'argsort'), "
                 "got 'radix'", id="index_builder"),
    pytest.param({"renormalize": 1}, "MoEConfig.renormalize must be a bool, got 1",
                 id="renormalize_int"),
    pytest.param({"top_k": 1, "renormalize": True},
                 "MoEConfig.renormalize must be False when top_k=1 (renormalised top-1 weights "
                 "are all 1.0, so the router would get no gradient from the output), got True",
                 id="renormalize_top1"),
    pytest.param({"aux_loss_coef": -0.1}, "MoEConfig.aux_loss_coef must be in [0.0, inf), "
                 "got -0.1", id="aux_negative"),
    pytest.param({"aux_loss_coef": float("nan")}, "MoEConfig.aux_loss_coef must be a finite "
                 "number, got nan", id="aux_nan"),
    pytest.param({"aux_loss_coef": float("inf")}, "MoEConfig.aux_loss_coef must be in "
                 "[0.0, inf), got inf", id="aux_inf"),
    pytest.param({"z_loss_coef": "0.1"}, "MoEConfig.z_loss_coef must be a finite number, "
                 "got '0.1'", id="z_str"),
    pytest.param({"z_loss_coef": -1}, "MoEConfig.z_loss_coef must be in [0.0, inf), got -1",
                 id="z_negative"),
    pytest.param({"skew_hot_experts": 9}, "MoEConfig.skew_hot_experts must be in [0, 8], got 9",
                 id="skew_hot_gt_E"),
    pytest.param({"skew_bias": -1.0}, "MoEConfig.skew_bias must be in [0.0, inf), got -1.0",
                 id="skew_bias_negative"),
    pytest.param({"skew_bias": 2.0}, "MoEConfig.skew_hot_experts must be >= 1 when "
                 "skew_bias > 0, got 0", id="skew_bias_without_hot"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_MOE)
def test_moe_config_rejects(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=_pattern(message)):
        _moe(**overrides)


# The six routing fields are declared once, on RouteOptions, and checked there for a MoEConfig too.
BAD_ROUTE = [
    pytest.param({"capacity_factor": 0.0}, "capacity_factor must be in (0.0, inf), got 0.0",
                 id="capacity_factor_0"),
    pytest.param({"min_capacity": -1}, "min_capacity must be >= 0, got -1", id="min_capacity"),
    pytest.param({"drop_policy": "random"}, "drop_policy must be one of ('probs', 'position'), "
                 "got 'random'", id="drop_policy"),
    pytest.param({"n_group": 2, "topk_group": 3}, "topk_group must be in [1, 2], got 3",
                 id="topk_group_gt_n_group"),
    pytest.param({"routed_scaling_factor": 0}, "routed_scaling_factor must be in (0.0, inf), "
                 "got 0", id="routed_scaling_0"),
]


@pytest.mark.parametrize("cls", [RouteOptions, MoEConfig])
@pytest.mark.parametrize(("overrides", "message"), BAD_ROUTE)
def test_route_options_reject(cls: type[RouteOptions], overrides: dict[str, object],
                              message: str) -> None:
    extra = MOE if cls is MoEConfig else {}
    with pytest.raises(ValueError, match=_pattern(f"{cls.__name__}.{message}")):
        cls(**{**extra, **overrides})


def test_n_group_bound_names_num_experts_only_in_moe_config() -> None:
    with pytest.raises(ValueError, match=_pattern("RouteOptions.n_group must be >= 1, got 0")):
        RouteOptions(n_group=0)
    for n_group in (0, 9):
        with pytest.raises(ValueError, match=_pattern(
                f"MoEConfig.n_group must be in [1, 8], got {n_group}")):
            _moe(n_group=n_group)
    assert RouteOptions(n_group=64, topk_group=3).n_group == 64  # no E to check against


def test_moe_config_declares_the_routing_fields_once() -> None:
    moe = _moe(capacity_factor=1.5, min_capacity=2, drop_policy="position", n_group=4,
               topk_group=2, routed_scaling_factor=2.5)
    route_fields = [f.name for f in dataclasses.fields(RouteOptions)]
    moe_fields = [f.name for f in dataclasses.fields(MoEConfig)]
    assert isinstance(moe, RouteOptions) and len(route_fields) == 6
    assert moe_fields[:6] == route_fields and len(set(moe_fields)) == len(moe_fields)
    assert RouteOptions(**{n: getattr(moe, n) for n in route_fields}).to_dict() == {
        "capacity_factor": 1.5, "min_capacity": 2, "drop_policy": "position", "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5}
    assert (moe.dropless, _moe().dropless, RouteOptions().dropless) == (False, True, True)

BAD_CHUNK = [
    pytest.param({"num_chunks": 0}, "ChunkConfig.num_chunks must be >= 1, got 0", id="chunks_0"),
    pytest.param({"memory_budget_bytes": 0}, "ChunkConfig.memory_budget_bytes must be >= 1, "
                 "got 0", id="budget_0"),
    pytest.param({"memory_budget_bytes": 1.0e9}, "ChunkConfig.memory_budget_bytes must be an "
                 "int of bytes (memfine.units.parse_bytes turns '16MiB' into one), got "
                 "1000000000.0", id="budget_float"),
    pytest.param({"bins": ()}, "ChunkConfig.bins must be a non-empty, strictly increasing tuple "
                 "of ints in [1, 16], got ()", id="bins_empty"),
    pytest.param({"bins": (2, 1)}, "ChunkConfig.bins must be a non-empty, strictly increasing "
                 "tuple of ints in [1, 16], got (2, 1)", id="bins_decreasing"),
    pytest.param({"bins": (1, 1)}, "ChunkConfig.bins must be a non-empty, strictly increasing "
                 "tuple of ints in [1, 16], got (1, 1)", id="bins_repeated"),
    pytest.param({"bins": (0, 1)}, "ChunkConfig.bins must be a non-empty, strictly increasing "
                 "tuple of ints in [1, 16], got (0, 1)", id="bins_zero"),
    pytest.param({"bins": (1, 2.0)}, "ChunkConfig.bins must be a non-empty, strictly "
                 "increasing tuple of ints in [1, 16], got (1, 2.0)", id="bins_float"),
    pytest.param({"bins": 4}, "ChunkConfig.bins must be a non-empty, strictly increasing tuple "
                 "of ints in [1, 16], got 4", id="bins_scalar"),
    pytest.param({"bins": (1, 32)}, "ChunkConfig.bins must be a non-empty, strictly increasing "
                 "tuple of ints in [1, 16], got (1, 32)", id="bins_above_16"),
    pytest.param({"recompute": "all"}, "ChunkConfig.recompute must be one of ('auto', 'none', "
                 "'experts', 'full'), got 'all'", id="recompute"),
    pytest.param({"allow_over_budget": "no"}, "ChunkConfig.allow_over_budget must be a bool, "
                 "got 'no'", id="allow_over_budget"),
    pytest.param({"memory_budget_bytes": "16MiB"}, "ChunkConfig.memory_budget_bytes must be an "
                 "int of bytes (memfine.units.parse_bytes turns '16MiB' into one), got '16MiB'",
                 id="budget_size_string"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CHUNK)
def test_chunk_config_rejects(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=_pattern(message)):
        ChunkConfig(**overrides)


BAD_MODEL = [
    pytest.param({"vocab_size": 0}, "ModelConfig.vocab_size must be >= 1, got 0", id="vocab_0"),
    pytest.param({"num_layers": 0}, "ModelConfig.num_layers must be >= 1, got 0", id="layers_0"),
    pytest.param({"num_heads": 0}, "ModelConfig.num_heads must be >= 1, got 0", id="heads_0"),
    pytest.param({"max_seq_len": -1}, "ModelConfig.max_seq_len must be >= 1, got -1",
                 id="seq_negative"),
    pytest.param({"num_heads": 3}, "ModelConfig.num_heads must be a divisor of "
                 "moe.hidden_size=16, got 3", id="heads_not_divisor"),
    pytest.param({"num_heads": 16}, "ModelConfig.num_heads must be a divisor of "
                 "moe.hidden_size=16 giving an even head size (rotary embeddings), got 16",
                 id="head_size_odd"),
    pytest.param({"moe": dict(MOE)}, f"ModelConfig.moe must be a MoEConfig, got {dict(MOE)!r}",
                 id="moe_dict"),
    pytest.param({"chunk": None}, "ModelConfig.chunk must be a ChunkConfig, got None",
                 id="chunk_none"),
    pytest.param({"rope_theta": 0.0}, "ModelConfig.rope_theta must be in (0.0, inf), got 0.0",
                 id="rope_theta_0"),
    pytest.param({"norm_eps": -1e-6}, "ModelConfig.norm_eps must be in (0.0, inf), got -1e-06",
                 id="norm_eps_negative"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_MODEL)
def test_model_config_rejects(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=_pattern(message)):
        _model(**overrides)


BAD_TRAIN = [
    pytest.param({"model": None}, "TrainConfig.model must be a ModelConfig, got None",
                 id="model_none"),
    pytest.param({"data": " "}, "TrainConfig.data must be 'pydoc', 'stdlib' or a path to text, "
                 "got ' '", id="data_blank"),
    pytest.param({"val_fraction": 0.0}, "TrainConfig.val_fraction must be in (0.0, 0.5], "
                 "got 0.0", id="val_fraction_0"),
    pytest.param({"val_fraction": 0.7}, "TrainConfig.val_fraction must be in (0.0, 0.5], "
                 "got 0.7", id="val_fraction_high"),
    pytest.param({"seq_len": 257}, "TrainConfig.seq_len must be in [1, 256], got 257",
                 id="seq_len_gt_max_seq_len"),
    pytest.param({"batch_size": 0}, "TrainConfig.batch_size must be >= 1, got 0", id="batch_0"),
    pytest.param({"max_steps": -1}, "TrainConfig.max_steps must be in [1, 4294967295], got -1",
                 id="max_steps_negative"),
    pytest.param({"max_steps": 0}, "TrainConfig.max_steps must be in [1, 4294967295], got 0",
                 id="max_steps_0"),  # a run of no step would write its files and exit 0
    pytest.param({"max_steps": 2**32}, "TrainConfig.max_steps must be in [1, 4294967295], got "
                 "4294967296", id="max_steps_2_32"),
    pytest.param({"lr": 0.0}, "TrainConfig.lr must be in (0.0, inf), got 0.0", id="lr_0"),
    pytest.param({"min_lr_ratio": 1.5}, "TrainConfig.min_lr_ratio must be in [0.0, 1.0], "
                 "got 1.5", id="min_lr_ratio_high"),
    pytest.param({"warmup_steps": -1}, "TrainConfig.warmup_steps must be >= 0, got -1",
                 id="warmup_negative"),
    pytest.param({"warmup_steps": 10, "lr_decay_steps": 5}, "TrainConfig.lr_decay_steps must "
                 "be >= 10, got 5", id="decay_before_warmup"),
    pytest.param({"weight_decay": -0.1}, "TrainConfig.weight_decay must be in [0.0, inf), "
                 "got -0.1", id="weight_decay_negative"),
    pytest.param({"grad_clip": float("nan")}, "TrainConfig.grad_clip must be a finite number, "
                 "got nan", id="grad_clip_nan"),
    pytest.param({"seed": -1}, "TrainConfig.seed must be in [0, 4294967295], got -1",
                 id="seed_negative"),
    pytest.param({"seed": 2**32}, "TrainConfig.seed must be in [0, 4294967295], got 4294967296",
                 id="seed_2_32"),
    pytest.param({"save_every": 0}, "TrainConfig.save_every must be >= 1, got 0",
                 id="save_every_zero"),
    pytest.param({"eval_every": 0}, "TrainConfig.eval_every must be >= 1, got 0", id="eval_0"),
    pytest.param({"eval_batches": 0}, "TrainConfig.eval_batches must be >= 1, got 0",
                 id="eval_batches_0"),
    pytest.param({"log_every": 0}, "TrainConfig.log_every must be >= 1, got 0", id="log_0"),
    pytest.param({"sample_tokens": -5}, "TrainConfig.sample_tokens must be >= 0, got -5",
                 id="sample_negative"),
    pytest.param({"dtype": "fp8"}, "TrainConfig.dtype must be one of ('float32', 'bfloat16', "
                 "'float16', 'float64'), got 'fp8'", id="dtype"),
    pytest.param({"device": "gpu"}, "TrainConfig.device must be 'cpu' or 'cuda[:i]', got 'gpu'",
                 id="device"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_TRAIN)
def test_train_config_rejects(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=_pattern(message)):
        TrainConfig(**overrides)


def test_moe_config_derived_widths() -> None:
    assert (_moe().gated, _moe().up_width) == (True, 64)
    assert (_moe(activation="geglu").up_width, _moe(activation="relu").up_width) == (64, 32)
    assert not _moe(activation="silu").gated


def test_top_k_equals_num_experts_and_top1_without_renormalize_are_valid() -> None:
    assert _moe(top_k=8).top_k == 8
    assert _moe(top_k=1, renormalize=False).renormalize is False


CONFIGS = [
    pytest.param(RouteOptions(capacity_factor=1.25, min_capacity=4, drop_policy="position",
                              n_group=4, topk_group=2, routed_scaling_factor=2.5), id="route"),
    pytest.param(_moe(score_func="sigmoid", activation="relu", aux_loss_coef=0.0), id="moe"),
    pytest.param(ChunkConfig(num_chunks=3, memory_budget_bytes=1 << 20, bins=(1, 3, 9),
                             recompute="full", allow_over_budget=True), id="chunk"),
    pytest.param(_model(chunk=ChunkConfig(bins=[1, 2]), max_seq_len=64), id="model"),
    pytest.param(TrainConfig(model=_model(max_seq_len=64), seq_len=64, lr_decay_steps=500,
                             dtype="bfloat16", device="cuda:1"), id="train"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_to_dict_from_dict_round_trip(config: Config) -> None:
    data = config.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(config)}
    assert type(config).from_dict(data) == config
    assert type(config).from_dict(json.loads(json.dumps(data))) == config  # JSON-ready


def test_nested_dict_is_plain() -> None:
    data = _model(chunk=ChunkConfig(bins=[1, 2])).to_dict()
    assert data["moe"] == _moe().to_dict()
    assert data["chunk"]["bins"] == [1, 2]
    assert ChunkConfig(bins=[1, 2]).bins == (1, 2)  # lists are normalised to tuples


@pytest.mark.parametrize("config", CONFIGS)
def test_from_dict_rejects_unknown_keys(config: Config) -> None:
    cls = type(config)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: unknown keys \['bogus'\]; allowed"):
        cls.from_dict({**config.to_dict(), "bogus": 1})


def test_from_dict_rejects_unknown_nested_key_and_non_dict() -> None:
    data = _model().to_dict()
    data["moe"]["n_experts"] = 4
    with pytest.raises(ValueError, match=r"^MoEConfig: unknown keys \['n_experts'\]"):
        ModelConfig.from_dict(data)
    with pytest.raises(ValueError, match=r"^MoEConfig\.from_dict expects a dict, got list$"):
        MoEConfig.from_dict([("hidden_size", 4)])  # type: ignore[arg-type]


def test_from_dict_names_missing_keys() -> None:
    """A field without a default left out: ValueError naming the class, the keys, the allowed."""
    with pytest.raises(ValueError, match=r"^MoEConfig: missing keys \['hidden_size', "
                       r"'intermediate_size', 'top_k'\] \(they have no default\); allowed "
                       r"\['activation', .*'top_k', 'topk_group', 'z_loss_coef'\]$"):
        MoEConfig.from_dict({"num_experts": 4})
    data = _model().to_dict()
    del data["moe"]["top_k"]  # nested: the sub-config names itself
    with pytest.raises(ValueError, match=r"^MoEConfig: missing keys \['top_k'\]"):
        ModelConfig.from_dict(data)
    assert RouteOptions.from_dict({}) == RouteOptions()  # every field has a default


def test_from_dict_validates_values() -> None:
    with pytest.raises(ValueError, match=_pattern(
            "MoEConfig.top_k must be in [1, num_experts=8], got 9")):
        MoEConfig.from_dict({**MOE, "top_k": 9})


@pytest.mark.parametrize("config", CONFIGS)
def test_configs_are_frozen_slotted_and_keyword_only(config: Config) -> None:
    name = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, getattr(config, name))
    assert not hasattr(config, "__dict__")
    with pytest.raises(TypeError):
        type(config)(*[getattr(config, f.name) for f in dataclasses.fields(config)])


def test_replace_revalidates() -> None:
    with pytest.raises(ValueError, match=_pattern(
            "MoEConfig.top_k must be in [1, num_experts=4], got 8")):
        dataclasses.replace(_moe(), num_experts=4, top_k=8)
    assert dataclasses.replace(_moe(), top_k=4).top_k == 4


def test_train_schedule_steps() -> None:
    config = TrainConfig(max_steps=10, eval_every=4, log_every=3, warmup_steps=2)
    steps = range(1, 11)
    assert [s for s in steps if config.evaluates_at(s)] == [4, 8, 10]
    assert [s for s in steps if config.saves_at(s)] == [4, 8, 10]  # at each evaluation
    assert [s for s in steps if config.logs_at(s)] == [3, 4, 6, 8, 9, 10]
    saving = dataclasses.replace(config, save_every=3)
    assert [s for s in steps if saving.saves_at(s)] == [3, 6, 9, 10]


@pytest.mark.parametrize(("overrides", "expected"), [
    pytest.param({"max_steps": 10, "warmup_steps": 2}, 10, id="max_steps"),
    pytest.param({"max_steps": 10, "warmup_steps": 20}, 20, id="shorter_than_warmup"),
    pytest.param({"max_steps": 10, "warmup_steps": 0}, 10, id="no_warmup"),
    pytest.param({"max_steps": 10, "warmup_steps": 2, "lr_decay_steps": 7}, 7, id="given"),
])
def test_resolved_lr_decay_steps(overrides: dict[str, int], expected: int) -> None:
    assert TrainConfig(**overrides).resolved_lr_decay_steps == expected  # type: ignore[arg-type]
