"""memfine's torchtitan config functions, the ``--override.imports`` override, quantised experts,
and the first-step memory report and chunk decisions of converted blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed "
                    "(pip install -c constraints.txt -e '.[torchtitan]')")

import torch  # noqa: E402
from torchtitan_models import build_model, forward_tokens, model_config  # noqa: E402

from memfine.config import CPU_MAX_BLOCK_ROWS, ChunkConfig, MoEConfig  # noqa: E402
from memfine.integrations import torchtitan_configs  # noqa: E402
from memfine.integrations.torchtitan import convert_model  # noqa: E402
from memfine.integrations.torchtitan_budget import (  # noqa: E402
    budget_report,
    format_budget_report,
    last_decisions,
)
from memfine.schedule.policy import ChunkDecision, ChunkPolicy  # noqa: E402

OVERRIDE = "memfine.integrations.torchtitan_modules.memfine_experts"
CONFIG_FUNCTIONS = [  # (memfine function, torchtitan module)
    ("qwen3_moe_debug", "qwen3"), ("qwen3_30b_a3b", "qwen3"),
    ("deepseek_v3_debugmodel", "deepseek_v3"), ("deepseek_v3_16b", "deepseek_v3"),
    ("deepseek_v3_671b", "deepseek_v3"), ("gpt_oss_debugmodel", "gpt_oss"),
    ("gpt_oss_20b", "gpt_oss"), ("gpt_oss_120b", "gpt_oss"),
]


def _routed(config) -> list:
    from torchtitan.models.common.moe import RoutedExperts

    return [cfg for _, cfg, _, _ in config.model_spec.traverse(RoutedExperts.Config)]


@pytest.mark.parametrize(("name", "module"), CONFIG_FUNCTIONS)
def test_config_function_is_torchtitans_with_memfine_experts(name: str, module: str) -> None:
    import importlib
    from dataclasses import fields

    from memfine.integrations.torchtitan_modules import MemfineRoutedExperts

    ours = getattr(torchtitan_configs, name)()
    theirs = getattr(importlib.import_module(f"torchtitan.models.{module}.config_registry"),
                     name)()
    mine, base = _routed(ours), _routed(theirs)
    assert len(mine) == len(base) > 0
    for m, b in zip(mine, base, strict=True):
        assert type(m) is MemfineRoutedExperts.Config
        assert m.memfine.chunk == ChunkConfig()
        # param_init holds functools.partial objects, equal by identity only: compare reprs
        assert all(repr(getattr(m, f.name)) == repr(getattr(b, f.name)) for f in fields(b))
    assert ours.training == theirs.training and ours.parallelism == theirs.parallelism


def _parsed(module: str, config: str, *overrides: str):
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    args = ["--module", module, "--config", config]
    if overrides:
        args += ["--override.imports", *overrides]
    cfg = ConfigManager().parse_args(args)
    apply_overrides(cfg.override, cfg)  # as Trainer.__init__ does
    return cfg


@pytest.mark.parametrize("module", ["memfine.integrations.torchtitan_configs", "qwen3"])
def test_override_sets_options_from_the_command_line(module: str) -> None:
    cfg = _parsed(module, "qwen3_moe_debug",
                  f'{OVERRIDE}={{"num_chunks": 3, "memory_budget": "64MiB"}}')
    routed = _routed(cfg)
    assert len(routed) == 8
    for r in routed:
        assert r.memfine.chunk.num_chunks == 3
        assert r.memfine.chunk.memory_budget_bytes == 64 * 2**20


def test_config_function_without_override_keeps_defaults() -> None:
    cfg = _parsed("memfine.integrations.torchtitan_configs", "qwen3_moe_debug")
    assert all(r.memfine.chunk == ChunkConfig() for r in _routed(cfg))


def test_override_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="num_chunks"):
        _parsed("qwen3", "qwen3_moe_debug", f'{OVERRIDE}={{"num_chunks": 0}}')


@pytest.mark.parametrize(("factory", "converter"), [
    ("torchtitan.components.quantization.float8._get_float8_grouped_experts_cls",
     "Float8GroupedExpertsConverter"),
    ("torchtitan.components.quantization.mx._get_mxfp8_grouped_experts_cls",
     "MXFP8GroupedExpertsConverter"),
])
def test_quantised_experts_are_refused_naming_the_converter(factory: str,
                                                            converter: str) -> None:
    """torchtitan's quantisation converters need torchao and a recent GPU; their experts classes
    (the subclasses they build) are made here directly, config and module alike."""
    import importlib
    from dataclasses import fields

    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    from memfine.integrations.torchtitan_configs import with_memfine

    module_name, fn = factory.rsplit(".", 1)
    quantised = getattr(importlib.import_module(module_name), fn)(GroupedExperts)
    message = f"drop {converter} from the model's converters"

    cfg = qwen3_moe_debug()
    for r in _routed(cfg):
        inner = r.inner_experts
        r.inner_experts = quantised.Config(**{f.name: getattr(inner, f.name)
                                              for f in fields(inner)})
    with pytest.raises(ValueError, match=message):
        with_memfine(cfg)

    model = build_model(model_config("qwen3"))
    for m in model.modules():
        if type(m) is GroupedExperts:
            m.__class__ = quantised
    with pytest.raises(ValueError, match=message):
        convert_model(model)


def _tiny_policy(k: int, **chunk: int | None) -> ChunkPolicy:
    """A fresh chunk policy of the test blocks' sizes (fp32 SwiGLU experts, E = 6, d = 32)."""
    moe = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=6, top_k=k,
                    renormalize=False, activation="swiglu")
    return ChunkPolicy(ChunkConfig(**chunk), moe)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [{}, {"num_chunks": 3}, {"budget_c": 2}], ids=str)
def test_budget_report_and_decisions_follow_the_memory_model(chunk: dict) -> None:
    B, L, k = 2, 12, 2
    T, S = B * L, B * L * k
    report_policy = _tiny_policy(k, memory_budget_bytes=1)  # what a budget would run
    peaks = {c: report_policy.predicted_peak(S, T, 4, c) for c in (1, 2, 4, 8)}
    assert peaks[2] < peaks[1]  # chunks lower the exact peak at these sizes
    options = dict(chunk)
    c = options.pop("budget_c", None)
    budget = None
    if c is not None:  # the exact peak at c, which c = 1 exceeds: MACT picks exactly c
        budget = options["memory_budget"] = peaks[c]
    want_c = c or options.get("num_chunks", 1)
    want_peak = _tiny_policy(k, num_chunks=options.get("num_chunks", 1),
                             memory_budget_bytes=budget).predicted_peak(S, T, 4, want_c)
    want_recompute = "none" if want_c == 1 and budget is None else "experts"
    model = build_model(model_config("qwen3", n_layers=2))
    names = convert_model(model, **options)
    assert set(last_decisions(model)) == set(names) == set(budget_report(model))
    assert all(v is None for v in last_decisions(model).values())
    assert "no forward yet" in format_budget_report(model)

    forward_tokens(model, torch.randint(0, 64, (B, L))).sum().backward()
    for name in names:
        report, decision = budget_report(model)[name], last_decisions(model)[name]
        assert (report.tokens, report.rows, report.dtype_bytes) == (T, S, 4)
        assert report.fixed_bytes == report_policy.predicted_peak(0, 0, 4, 1) > 0
        assert report.token_bytes == peaks[1] - report.fixed_bytes > 0
        assert report.bins == tuple(peaks) and report.bin_peak_bytes == tuple(peaks.values())
        assert report.smallest_feasible_budget_bytes == report_policy.smallest_feasible_budget(
            S, T, 4) == min(peaks.values())
        # at these sizes every block of the ladder holds all rows: the default is the choice
        assert decision == ChunkDecision(want_c, want_recompute, S, want_peak, budget, min(
            CPU_MAX_BLOCK_ROWS, (16 << 20) // ((3 * 32 + 3 * 16 + 32) * 4)))  # the CPU's
        # default block in rows (16 MiB of fp32 rows, at most the CPU's cap)
    text = format_budget_report(model)
    assert all(name in text for name in names) and "smallest feasible memory_budget" in text
