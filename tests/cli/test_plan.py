"""``memfine plan``: flag set, JSON against hand-worked MemFine Eq. 8/9 numbers, infeasible runs."""

from __future__ import annotations

import argparse
import json

import pytest

from memfine.cli import plan as plan_cli
from memfine.cli.main import main
from memfine.memory.planner import s_prime_max_memfine
from memfine.units import format_bytes

# A small model worked by hand: d=64, n=32, E=8, k=2, L=2 MoE layers, a=k_a=4 heads of 16;
# bf16 (D_t=2), b=1, s=128, e=4 (E/e=2 local experts, worst skew 4·min(2, 2)/2 = 4).
SMALL = ["--hidden-size", "64", "--moe-intermediate-size", "32", "--num-experts", "8",
         "--top-k", "2", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "4",
         "--head-dim", "16", "--vocab-size", "1000", "--seq-len", "128", "--micro-batch", "1",
         "--dtype", "bfloat16", "--e", "4", "--dp", "4", "--recompute", "full",
         "--device-memory", "1MiB", "--alpha", "1", "--static-memory", "767488",
         "--skew", "1,2,4"]
ATTENTION = 2 * 128 * (5 * 64 + 4 * 16 + 2 * 4 * 16 + 8)  # Table 2 width 520 → 133120 bytes
CHECKPOINTS = 2 * (2 * 128 * 64)  # the two layer inputs kept by full recompute: 32768 bytes
FIXED = CHECKPOINTS + ATTENTION  # 165888 bytes
ROW = 2 * (2 * 64 + 2 * 32)  # D_t·(2d + 2n) = 384 bytes per received row
S_MAX = (1 << 20) - 767488 - FIXED  # 115200 bytes left → 300 rows


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_flag_set_is_pinned() -> None:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {
        "--preset", "--hidden-size", "--moe-intermediate-size", "--num-experts", "--top-k",
        "--num-layers", "--num-dense-layers", "--dense-intermediate-size",
        "--num-shared-experts", "--shared-intermediate-size", "--num-heads", "--num-kv-heads",
        "--head-dim", "--attention-params", "--vocab-size", "--device-memory", "--alpha",
        "--micro-batch", "--seq-len", "--dtype", "--recompute", "--t", "--p", "--e", "--dp",
        "--cp", "--v", "--skew", "--bins", "--grad-bytes", "--optimizer-bytes",
        "--no-distributed-optimizer", "--static-memory", "--expert-model", "--json"}


def test_json_matches_hand_worked_eq8_eq9(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*SMALL, "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert set(plan) == {"config", "layer_activation", "stages", "fits",
                         "min_device_memory_bytes", "errors"}
    moe = plan["layer_activation"]["moe"]
    assert moe["attention_bytes"] == ATTENTION and moe["expert_row_bytes"] == ROW
    (stage,) = plan["stages"]
    assert stage["static_bytes"] == 767488 and stage["budget_bytes"] == 1 << 20
    assert stage["fixed_activation_bytes"] == FIXED and stage["row_bytes"] == ROW
    assert stage["s_prime_max"] == S_MAX // ROW == 300
    rows = [sk["recv_rows"] for sk in stage["skews"]]
    assert rows == [256, 512, 1024]  # s·k·skew
    assert [sk["chunks_needed"] for sk in stage["skews"]] == [1, 2, 4]  # ⌈s″/300⌉ (Eq. 9)
    assert [sk["num_chunks"] for sk in stage["skews"]] == [1, 2, 4]  # smallest bin ≥ it
    assert [sk["activation_bytes"] for sk in stage["skews"]] == [FIXED + ROW * 256] * 3
    assert stage["skews"][2]["activation_unchunked_bytes"] == FIXED + ROW * 1024
    assert plan["fits"] and plan["errors"] == []
    # MemFine Eq. 8 as printed (m_g = 1), with the checkpoints counted with the static memory:
    assert s_prime_max_memfine(
        device_memory_bytes=1 << 20, alpha=1.0, static_bytes=767488 + CHECKPOINTS, in_flight=1,
        t=1, cp=1, dtype_bytes=2, micro_batch=1, seq_len=128, attention_width=520,
        expert_width=192) == stage["s_prime_max"]


def test_table_shows_binary_units(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(SMALL, capsys)
    assert code == 0
    assert out.startswith("config: {")
    assert "MiB" in out and " GB" not in out and " MB" not in out
    assert "s'_max 300 rows" in out


def test_chunk_count_above_largest_bin_is_infeasible(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    code, out, err = _run([*SMALL, "--bins", "1,2"], capsys)
    assert code == 1
    need = 767488 + FIXED + ROW * 512  # the largest bin c=2 at s″=1024
    assert ("stage 0 at skew 4: s''=1024 rows need c=ceil(1024/300)=4 > largest bin 2; the "
            f"smallest device memory that fits (c=2, alpha=1) is {format_bytes(need)}") in err
    assert "Traceback" not in err
    assert "NO" in out


def test_budget_below_static_is_infeasible(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([*SMALL[:-4], "--static-memory", "2MiB", "--skew", "1,4", "--json"],
                          capsys)
    assert code == 1
    plan = json.loads(out)
    need = (2 << 20) + FIXED + ROW * (1024 // 8)
    assert plan["min_device_memory_bytes"] == need
    assert err.count("infeasible") == 1
    assert (f"exceed the budget alpha*M = {format_bytes(1 << 20)}; the smallest device memory "
            f"that fits (skew 4, c=8, alpha=1) is {format_bytes(need)}") in err


def test_paper_preset_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--preset", "memfine-paper-II", "--skew", "1,worst", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    cfg = plan["config"]
    assert (cfg["dtype"], cfg["micro_batch"], cfg["seq_len"], cfg["recompute"]) == (
        "bfloat16", 1, 4096, "full")
    assert cfg["device_memory_bytes"] == 64 << 30 and cfg["skews"] == [1.0, 32.0]
    (stage,) = plan["stages"]
    attention = 2 * 4096 * (5 * 7168 + 128 * 128 + 2 * 128 * 128 + 256)
    shared = 2 * 4096 * (2 * 7168 + 2 * 2048)
    checkpoints = 8 * 2 * 4096 * 7168
    assert stage["fixed_activation_bytes"] == checkpoints + attention + shared
    assert stage["row_bytes"] == 2 * (2 * 7168 + 2 * 2048)
    assert stage["static_bytes"] == int(39.5 * 2**30)


def test_missing_sizes_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--hidden-size", "64"])
    assert exc.value.code == 2
    assert "give --preset or the model sizes; missing --moe-intermediate-size" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("preset", sorted(plan_cli.PRESETS))
def test_every_preset_plans(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--preset", preset, "--skew", "1", "--json"], capsys)
    plan = json.loads(out)
    assert code == (0 if plan["fits"] else 1)
    assert (code == 1) == ("infeasible" in err)
    assert plan["config"]["model"]["name"] == preset


def test_memfine_expert_model_uses_the_fused_row_bytes(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from memfine.config import MoEConfig
    from memfine.memory.layer import expert_row_bytes

    code, out, _ = _run([*SMALL, "--expert-model", "memfine", "--json"], capsys)
    local = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=2, top_k=2)
    assert code == 0
    assert json.loads(out)["stages"][0]["row_bytes"] == expert_row_bytes(local, 2,
                                                                         recompute="full")
