"""The ``counts`` suite: exact counts in the shared CSV schema, independent of d and n."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest
import torch

from memfine.bench.options import BenchOptions, LayerShape
from memfine.config import backward_block_rows
from memfine.suites import counts
from memfine.suites.runner import run_suites

TINY = LayerShape(name="tiny", tokens=48, hidden_size=256, intermediate_size=128,
                  num_experts=16, top_k=4)
NAMES = ("fused", "fused_one_block", "chunked_c4", "torchtitan_style", "grouped_mm")


def _by_name(results: list[counts.Counted]) -> dict[str, counts.Counted]:
    assert all(r.error is None for r in results), [r.error for r in results]
    return {r.name: r for r in results}


def test_block_bytes_keep_the_real_dims_block_rows() -> None:
    real = counts.PRESETS["qwen3-30b-a3b"]
    shape = counts.scaled(real)
    block = counts.block_bytes_keeping_rows(real, shape)
    # CUDA's 512 MiB / ((3·2048 + 3·768 + 1536) · 2 bytes) = 26,886 rows at the real dims
    assert backward_block_rows(block, shape.hidden_size, shape.intermediate_size,
                               2 * shape.intermediate_size, 2) == 26_886
    # the counted CUDA default is an H200's, 141 GB ÷ 32: 220,665 rows, T 16384's 131,072 in one
    default = counts.block_bytes_keeping_rows(real, shape, counts.BLOCK_BYTES["cuda"])
    assert counts.BLOCK_BYTES["cuda"] == 141 * 10**9 // 32
    assert backward_block_rows(default, shape.hidden_size, shape.intermediate_size,
                               2 * shape.intermediate_size, 2) == 220_665


def test_counts_do_not_depend_on_d_and_n_at_equal_block_rows() -> None:
    # every expert gets rows in every chunk, so the routing (which changes with d) does not
    # change which (block, expert) pairs the per-expert loops visit
    real = dataclasses.replace(TINY, tokens=64, num_experts=4, top_k=2)
    _, _, by8 = counts.count_shape(real, NAMES, dim_scale=8, warmup=False)
    _, _, by16 = counts.count_shape(real, NAMES, dim_scale=16, warmup=False)
    a, b = _by_name(by8), _by_name(by16)
    for name in NAMES:
        for mode in counts.MODES:
            pa, pb = a[name].phase(mode), b[name].phase(mode)
            assert (pa.ops, pa.syncs, len(pa.grouped_mm)) == (pb.ops, pb.syncs,
                                                              len(pb.grouped_mm)), (name, mode)


def test_warm_up_call_does_not_change_the_counts() -> None:
    warm = _by_name(counts.count_shape(TINY, ("fused", "torchtitan_style"))[2])
    cold = _by_name(counts.count_shape(TINY, ("fused", "torchtitan_style"), warmup=False)[2])
    for name in warm:
        assert warm[name].phase("full").ops == cold[name].phase("full").ops


def test_suite_writes_exact_counts_in_the_shared_schema(tmp_path: Path) -> None:
    methods = ("fused", "torchtitan_style")
    opts = BenchOptions(suites=("counts",), tokens=32, num_experts=16, methods=methods,
                        out=str(tmp_path), quick=True)
    assert run_suites(opts, torch.device("cpu")) == []
    with (tmp_path / "bench_counts.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["x_value"] for r in rows} == {f"{p}/T32" for p in counts.PRESETS}
    assert {r["method"] for r in rows} == set(methods)
    assert {r["mode"] for r in rows} == {"fwd", "bwd", "full"}
    units = {r["metric"]: r["unit"] for r in rows}
    assert units["non_view_ops"] == "ops" and units["syncs_item"] == "syncs"
    assert units["grouped_mm_cuda_fast_path_calls"] == "calls"
    assert units["hbm_bytes"] == "bytes" and units["roofline_ms_h200"] == "ms"
    assert all(r["torch_version"] and r["git_sha"] and r["config_json"] for r in rows)

    def value(preset: str, method: str, mode: str, metric: str) -> int:
        (row,) = [r for r in rows if (r["x_value"], r["method"], r["mode"], r["metric"]) ==
                  (f"{preset}/T32", method, mode, metric)]
        assert row["p20"] == row["p50"] == row["p80"]
        return int(row["p50"])

    real = dataclasses.replace(counts.PRESETS["qwen3-30b-a3b"], tokens=32, num_experts=16)
    expected = _by_name(counts.count_shape(real, methods)[2])
    for method in methods:
        for mode in counts.MODES:
            assert value("qwen3-30b-a3b", method, mode, "non_view_ops") == (
                expected[method].phase(mode).non_view_ops)
        assert value("qwen3-30b-a3b", method, "full", "non_view_ops") == (
            value("qwen3-30b-a3b", method, "fwd", "non_view_ops")
            + value("qwen3-30b-a3b", method, "bwd", "non_view_ops"))


def test_other_devices_are_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(counts.run(BenchOptions(suites=("counts",)), torch.device("meta"), NAMES)) == []
    assert "skipped" in capsys.readouterr().out


def test_tokens_that_do_not_fit_are_refused() -> None:
    for tokens in (4, counts.MAX_TOKENS + 1):
        with pytest.raises(ValueError, match=rf"--tokens must be an int in \[8, "
                                             rf"{counts.MAX_TOKENS}\] for the counts suite .*"
                                             rf"got {tokens}"):
            counts.shapes(BenchOptions(suites=("counts",), tokens=tokens))
    points = counts.shapes(BenchOptions(suites=("counts",)))
    assert [(p.name, p.tokens) for p in points] == [
        ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096)]


def test_the_counted_device_picks_the_combine() -> None:
    """CUDA's path sums rows per token with the sorted ``index_put_(accumulate=True)``, the
    CPU's with ``index_add_``; the counted dims read back as the real ones."""
    real = dataclasses.replace(TINY, tokens=64)
    ops = {}
    for device in ("cuda", "cpu"):
        _, _, results = counts.count_shape(real, ("fused",), warmup=False, device=device)
        ops[device] = _by_name(results)["fused"].phase("fwd").ops
    assert ops["cuda"]["aten.index_put_.default"] > 0
    assert "aten.index_add_.default" not in ops["cuda"]
    assert ops["cpu"]["aten.index_add_.default"] > 0
    shape = counts.scaled(counts.PRESETS["qwen3-30b-a3b"])
    assert counts.dim_map(counts.PRESETS["qwen3-30b-a3b"], shape) == {
        shape.hidden_size: 2048, shape.intermediate_size: 768,
        2 * shape.intermediate_size: 1536}
    assert shape.hidden_size != shape.num_experts  # 2048 / 16 = E: moved to a distinct size


def test_bad_count_device_is_refused() -> None:
    with pytest.raises(ValueError, match="count_device"):
        BenchOptions(suites=("counts",), count_device="tpu")


def test_device_path_resolves_the_device_default_to_the_counted_block() -> None:
    """Paths without a block setting of their own (transformers' experts backend) count the
    counted device's default block while the suite counts, and the CPU's afterwards."""
    from memfine.config import DEFAULT_BACKWARD_BLOCK_BYTES, default_block_bytes
    from memfine.experts.device_path import device_path

    with device_path("cuda", 12_345_678):
        assert default_block_bytes("cpu") == 12_345_678
    assert default_block_bytes("cpu") == DEFAULT_BACKWARD_BLOCK_BYTES
    # Qwen3-30B-A3B at T 2048: one block at an H200's default, several at the CPU's 16 MiB
    real = dataclasses.replace(counts.PRESETS["qwen3-30b-a3b"], tokens=2048, num_experts=16)
    gmm = {device: len(_by_name(counts.count_shape(real, ("hf_memfine",), warmup=False,
                                                   device=device)[2])["hf_memfine"]
                       .phase("full").grouped_mm) for device in ("cuda", "cpu")}
    assert gmm["cuda"] == 6 < gmm["cpu"], gmm


def test_device_path_ranks_the_router_top_k_as_a_gpu_does() -> None:
    """A GPU's path counts the router's stable sort (one kernel), not the CPU's keyed topk; both
    pick the sort's experts, and the CPU's path comes back afterwards."""
    from memfine.counts.ops_count import OpCounter
    from memfine.experts.device_path import device_path
    from memfine.routing import top_k_lowest_index

    scores = torch.randint(0, 3, (64, 16)).float()  # ties in every row
    expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :4]

    def sorts() -> bool:
        with OpCounter() as counter:
            assert torch.equal(top_k_lowest_index(scores, 4), expected)
        return any("sort" in name for name in counter.total().ops)

    with device_path("cuda"):
        assert sorts()
    assert not sorts()
