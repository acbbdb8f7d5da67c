"""``memfine plan`` says what to do: the command that runs the chosen layout (parsed by the
command it names), ``--verbose`` tables under ``--search``, parallel sizes mixed with a preset's
refused, and a note on GB against GiB."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from memfine.cli.main import build_parser, main
from memfine.launch import memfine_train_command, torchtitan_command
from memfine.plan.layout import PlanConfig
from memfine.plan.presets import PRESETS
from memfine.plan.stage import plan_layout

ASSETS = Path(__file__).parents[2] / "assets" / "hf_configs"
TINY_SEARCH = ["--hf-config", str(ASSETS / "mixtral.json"), "--seq-len", "64", "--device-memory",
               "3MiB", "--global-batch", "64", "--dtype", "float32", "--search", "--devices", "4"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _train_argv(line: str) -> list[str]:
    """The ``memfine train`` arguments of a printed ``torchrun ... -m memfine train ...`` line."""
    words = shlex.split(line)
    return words[words.index("memfine") + 1:]


def test_a_data_and_expert_parallel_plan_prints_a_memfine_train_command_that_parses(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--preset", "olmoe-1b-7b"], capsys)  # t=1 e=2 dp=8: fits
    assert code == 0 and " fits: " in out.splitlines()[0]
    line = next(ln for ln in out.splitlines() if "-m memfine train" in ln)
    assert line.strip().startswith("torchrun --nproc-per-node 8 -m memfine train ")
    argv = _train_argv(line)
    args, unknown = build_parser().parse_known_args(argv)
    assert unknown == []
    assert (args.ep, args.dp_shard) == (2, 4)  # W = dp = 8 = dp_shard · ep
    m = PRESETS["olmoe-1b-7b"]
    assert [args.hidden_size, args.num_experts, args.top_k, args.num_layers] == [
        m.hidden_size, m.num_experts, m.top_k, m.num_layers]
    assert args.batch_size == 8 and args.grad_accum == 1024 // 8  # dp·b per micro-batch
    data = json.loads(_run(["--preset", "olmoe-1b-7b", "--json"], capsys)[1])
    assert data["commands"]["memfine_train"] == line.strip()
    assert data["commands"]["torchtitan"] is None  # no torchtitan config of OLMoE


def test_the_qwen3_plan_prints_torchtitans_command_with_every_parallel_degree() -> None:
    base = PRESETS["qwen3-30b-a3b"]
    cfg = PlanConfig(model=base, t=2, e=8, dp=4, recompute="full", global_batch=1024,
                     skews=(8.0,))
    plan = plan_layout(cfg)
    assert memfine_train_command(plan) is None  # t = 2: memfine train has no tensor parallelism
    line = torchtitan_command(plan)
    assert line is not None
    for flag in ("--config qwen3_30b_a3b", "--parallelism.tensor_parallel_degree 2",
                 "--parallelism.expert_parallel_degree 8",
                 "--parallelism.data_parallel_shard_degree 4", "--training.seq_len 4096",
                 "--training.global_batch_size 1024", "activation-checkpoint:full"):
        assert flag in line, flag


def test_a_plan_that_does_not_fit_prints_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--preset", "olmoe-1b-7b", "--device-memory", "8GiB"], capsys)
    assert code == 0 and "does not fit" in out and "torchrun" not in out


def test_search_verbose_adds_the_chosen_layouts_tables(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    _, plain, _ = _run(TINY_SEARCH, capsys)
    _, verbose, _ = _run([*TINY_SEARCH, "--verbose"], capsys)
    assert verbose != plain
    assert "#1 " in verbose and "skew      s_rows c_need MACT c" in verbose
    assert "stage 0: static" in verbose


def test_parallel_sizes_beside_a_presets_other_sizes_are_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3-30b-a3b's setting has t = 2: --expert-parallel 8 --data-parallel 8 would answer
    for 16 devices."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--preset", "qwen3-30b-a3b", "--expert-parallel", "8",
              "--data-parallel", "8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--tensor-parallel 2" in err and "16 devices" in err
    code, out, _ = _run(["--preset", "qwen3-30b-a3b", "--tensor-parallel", "1",
                         "--expert-parallel", "8", "--data-parallel", "8"], capsys)
    assert code == 0 and "on 8 × " in out


def test_device_memory_in_gb_gets_a_gib_note(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, err = _run(["--preset", "olmoe-1b-7b", "--device-memory", "80GB"], capsys)
    assert "80GB is 80,000,000,000 bytes = 74.51 GiB" in err and "80GiB" in err
    assert "74.51 GiB" in out
    _, _, err = _run(["--preset", "olmoe-1b-7b", "--device-memory", "80GiB"], capsys)
    assert "GB is" not in err


@pytest.mark.parametrize(("recompute", "p", "gib"), [("full", 2, 80), ("experts", 1, 79)])
def test_the_torchtitan_command_parses_with_torchtitans_own_config_manager(
        recompute: str, p: int, gib: int) -> None:
    """torchtitan's ConfigManager reads every flag (its own checks included: CUDA graphs off
    under pipeline and expert parallelism); at 79 GiB MACT needs c = 2, passed as an override."""
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    cfg = PlanConfig(model=PRESETS["qwen3-30b-a3b"], t=2, e=8, dp=4, p=p, recompute=recompute,
                     global_batch=1024, skews=(8.0,), device_memory_bytes=gib << 30)
    plan = plan_layout(cfg)
    line = torchtitan_command(plan)
    assert plan.fits and line is not None
    words = shlex.split(line)
    config = ConfigManager().parse_args(words[words.index("torchtitan.train") + 1:])
    assert (config.parallelism.tensor_parallel_degree, config.parallelism.pipeline_parallel_degree,
            config.parallelism.expert_parallel_degree,
            config.parallelism.data_parallel_shard_degree) == (2, p, 8, 4)
    assert config.training.global_batch_size == 1024 and config.training.seq_len == 4096
    assert type(config.activation_checkpoint).__qualname__ == (
        "FullAC.Config" if recompute == "full" else "NoneType")
    chunks = plan.limiting[1].num_chunks
    assert chunks is not None
    expected = ([("memfine.integrations.torchtitan_modules.memfine_experts",
                  {"num_chunks": chunks})] if recompute != "none" and chunks > 1 else [])
    assert config.override.imports == expected


def test_verbose_says_a_stage_s_static_reason_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Static bytes over the budget hold at every skew: one line, not one per skew."""
    code, out, _ = _run(["--preset", "olmoe-1b-7b", "--device-memory", "8GiB", "--verbose"],
                        capsys)
    reasons = [line for line in out.splitlines() if line.startswith("does not fit: stage 0:")]
    assert code == 0 and len(reasons) == 1, reasons
