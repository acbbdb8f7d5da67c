"""Expert parallelism over gloo: equal to one process on the concatenated batch.

Covers the EP experts (memfine.parallel.experts, notify, all_to_all), gradient reduction and
clipping (grads), full state dicts (state) and the training hooks (training). One spawn of 2
processes runs every scenario in the same process group, each scenario its own pytest case through
a module-scoped fixture; a 4-process spawn (EP 4, and EP 2 × DP 2) is marked slow.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ep_harness import check_outcome, run_scenarios, spawn

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.dispatch import build_routing_index
from memfine.nn import MoETransformerLM
from memfine.ops import run_experts
from memfine.parallel import (
    ExpertParallelExperts,
    ParallelContext,
    agree_num_chunks,
    all_to_all,
    build_context,
    check_expert_sharding,
    exchange_counts,
)
from memfine.parallel import collectives as collectives_mod
from memfine.parallel import experts as experts_mod
from memfine.parallel.training import ExpertParallelTraining
from memfine.schedule.policy import ChunkPolicy
from tolerances import CHUNKED_ATOL, assert_close

pytestmark = pytest.mark.distributed

D, N, K = 8, 12, 2  # G = 2n = 24 fp32 columns: 96-byte rows, grouped_mm-aligned

Routing = Callable[[int, int, torch.Generator], torch.Tensor]


def _balanced(T: int, E: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]


def _to_rank0(T: int, E: int, g: torch.Generator) -> torch.Tensor:
    """Every token picks experts {0, 1}: rank 0 receives every row, the others none."""
    return torch.tensor([[0, 1]] * T, dtype=torch.int64).view(T, K)


def _with_padding(T: int, E: int, g: torch.Generator) -> torch.Tensor:
    """Balanced, with every third token padding (sentinel id E in both slots)."""
    idx = _balanced(T, E, g)
    idx[::3] = E
    return idx


def _moe(E: int) -> MoEConfig:
    return MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)


def _case(ctx: ParallelContext, tokens: list[int], E: int, routing: Routing, *,
          num_chunks: int = 1, recompute: str = "none", policy: Any = None,
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """EP run of this rank's tokens and the single-process run of all ranks' tokens."""
    g = torch.Generator().manual_seed(1234)
    T_all = sum(tokens)
    x = torch.randn(T_all, D, generator=g)
    idx = routing(T_all, E, g)
    w = torch.rand(T_all, K, generator=g)
    w_up = torch.randn(E, D, 2 * N, generator=g) * 0.3
    w_down = torch.randn(E, N, D, generator=g) * 0.3
    grad_out = torch.randn(T_all, D, generator=g)

    leaves = [t.clone().requires_grad_() for t in (x, w, w_up, w_down)]
    ref = run_experts(leaves[0], leaves[1], build_routing_index(idx, E), leaves[2], leaves[3])
    (ref * grad_out).sum().backward()

    start = sum(tokens[: ctx.rank])
    stop = start + tokens[ctx.rank]
    local = ctx.local_experts(E)
    x_l = x[start:stop].clone().requires_grad_()
    w_l = w[start:stop].clone().requires_grad_()
    module = ExpertParallelExperts.from_full(w_up, w_down, _moe(E), ctx)
    out, c = module.run(x_l, idx[start:stop], w_l, num_chunks=num_chunks, recompute=recompute,
                        policy=policy)
    (out * grad_out[start:stop]).sum().backward()
    got = {"out": out, "x": x_l.grad, "w": w_l.grad, "w_up": module.w_up.grad,
           "w_down": module.w_down.grad}
    want = {"out": ref[start:stop], "x": leaves[0].grad[start:stop],
            "w": leaves[1].grad[start:stop], "w_up": leaves[2].grad[local.start:local.stop],
            "w_down": leaves[3].grad[local.start:local.stop]}
    return got, want, c


def _equals_single_process(ctx: ParallelContext, tokens: list[int], E: int, routing: Routing,
                           **kwargs: Any) -> None:
    got, want, _ = _case(ctx, tokens, E, routing, **kwargs)
    for name in got:  # output and every gradient within the fp32 forward tolerance
        assert_close(got[name], want[name], msg=name)


def _chunked_equals_unchunked(ctx: ParallelContext, tokens: list[int], E: int, routing: Routing,
                              ) -> None:
    base, _, _ = _case(ctx, tokens, E, routing)
    for c in (1, 2, 4):
        for recompute in ("none", "experts"):
            got, _, used = _case(ctx, tokens, E, routing, num_chunks=c, recompute=recompute)
            assert used == c
            torch.testing.assert_close(got["out"], base["out"], atol=CHUNKED_ATOL, rtol=0)
            torch.testing.assert_close(got["x"], base["x"], atol=CHUNKED_ATOL, rtol=0)
            torch.testing.assert_close(got["w"], base["w"], atol=CHUNKED_ATOL, rtol=0)
            # weight gradients are summed chunk by chunk in another order: the fp32 GRAD row
            for name in ("w_up", "w_down"):
                assert_close(got[name], base[name], grad=True, msg=f"c={c} {name}")


def _all_to_all_moves_rows_and_grads(ctx: ParallelContext) -> None:
    """Uneven and zero splits: rows land at the right rank in source order; backward returns
    every row's gradient to its origin (an exact invariant, float64)."""
    in_splits = [[2, 0], [1, 3]][ctx.rank]  # rank 0 sends nothing to rank 1
    out_splits = [[2, 1], [0, 3]][ctx.rank]
    x_MD = (100.0 * ctx.rank + torch.arange(sum(in_splits), dtype=torch.float64))[:, None]
    x_MD = x_MD.expand(-1, 3).clone().requires_grad_()
    y_SD = all_to_all(x_MD, out_splits, in_splits, ctx.ep_group)
    want = [[0.0, 1.0, 100.0], [101.0, 102.0, 103.0]][ctx.rank]
    torch.testing.assert_close(y_SD[:, 0], torch.tensor(want, dtype=torch.float64),
                               atol=0, rtol=0)
    (y_SD * y_SD.detach()).sum().backward()  # d/dx = the row's own value, sent back home
    torch.testing.assert_close(x_MD.grad, x_MD.detach(), atol=0, rtol=0)


def _recompute_reuses_counts(ctx: ParallelContext, E: int) -> None:
    """c=4 with recompute: one count exchange per call; each chunk's 3 all-to-alls run in forward,
    again in recompute and once more (inverted) in backward."""
    calls = {"notify": 0, "all_to_all": 0}
    notify, exchange = experts_mod.exchange_counts, collectives_mod._exchange

    def counting_notify(*args: Any, **kwargs: Any) -> Any:
        calls["notify"] += 1
        return notify(*args, **kwargs)

    def counting_exchange(*args: Any, **kwargs: Any) -> Any:
        calls["all_to_all"] += 1
        return exchange(*args, **kwargs)

    experts_mod.exchange_counts, collectives_mod._exchange = counting_notify, counting_exchange
    try:
        got, want, _ = _case(ctx, [6, 6], E, _to_rank0, num_chunks=4, recompute="experts")
    finally:
        experts_mod.exchange_counts, collectives_mod._exchange = notify, exchange
    assert calls == {"notify": 1, "all_to_all": 4 * 3 * 3}, calls
    for name in got:
        assert_close(got[name], want[name], msg=name)


def _budget_agreement(ctx: ParallelContext, tokens: list[int], E: int) -> int:
    """A budget that needs c=4 on the hot rank and c=1 elsewhere: every rank runs c=4."""
    moe = _moe(E)
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
    probe.transport_row_elements = moe.hidden_size  # as the EP path sets it: received x rows
    T, rows_hot = tokens[ctx.rank], sum(tokens) * K
    fixed, row = probe.fixed_bytes(T, 4), probe.row_bytes(4)
    budget = fixed + math.ceil(rows_hot / 4) * row  # s'_max = rows_hot/4 → hot rank needs c=4
    chunk = ChunkConfig(memory_budget_bytes=budget, recompute="experts")
    local_policy = ChunkPolicy(chunk, moe)  # identity agreement: this rank's own choice
    local_policy.transport_row_elements = moe.hidden_size
    idx = _to_rank0(T, E, torch.Generator())
    recv = exchange_counts(idx, E, (1,), ctx.ep_group).recv_tokens
    own = local_policy.num_chunks(recv, T, 4)
    assert own == (4 if ctx.ep_rank == 0 else 1), (own, recv)
    policy = ChunkPolicy(chunk, moe, agree_num_chunks=functools.partial(
        agree_num_chunks, group=ctx.ep_group))
    got, want, c = _case(ctx, tokens, E, _to_rank0, policy=policy)
    for name in got:
        assert_close(got[name], want[name], msg=name)
    return c


def _chunk_count_mismatch(ctx: ParallelContext, E: int) -> None:
    """Ranks asked for different fixed c: every rank raises (none waits for a missing chunk)."""
    g = torch.Generator().manual_seed(0)
    module = ExpertParallelExperts.from_full(torch.zeros(E, D, 2 * N), torch.zeros(E, N, D),
                                             _moe(E), ctx)
    with pytest.raises(ValueError, match="different chunk counts"):
        module.run(torch.randn(4, D, generator=g), _balanced(4, E, g), torch.rand(4, K),
                   num_chunks=1 + ctx.rank)


def _timeout_is_an_error(ctx: ParallelContext) -> None:
    """A rank that skips a collective makes the others fail after the group timeout."""
    group = dist.new_group(list(range(ctx.world_size)), timeout=datetime.timedelta(seconds=2))
    if ctx.rank == 0:
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()


def _lm_step_equals_single_process(ctx: ParallelContext, chunk: ChunkConfig) -> None:
    """One training step of the LM: EP (+DP) gradients, clipped norm, full states == one process.

    The load-balancing loss (global-batch f, local P) and the z-loss are both on.
    """
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    config = ModelConfig(num_layers=2, num_heads=2, max_seq_len=16, moe=moe, chunk=chunk)
    torch.manual_seed(0)
    ref = MoETransformerLM(config)
    torch.manual_seed(0)
    model = MoETransformerLM(config)
    hooks = ExpertParallelTraining(ctx)
    hooks.check(num_experts=4, batch_size=2 * ctx.world_size)
    hooks.prepare_model(model)
    g = torch.Generator().manual_seed(5)
    x_BQ, y_BQ = (torch.randint(0, 256, (2 * ctx.world_size, 16), generator=g) for _ in "xy")

    def step(lm: MoETransformerLM, x: torch.Tensor, y: torch.Tensor) -> torch.optim.Optimizer:
        out = lm(x, y)
        (out.loss + moe.aux_loss_coef * out.load_balancing_loss
         + moe.z_loss_coef * out.z_loss).backward()
        return torch.optim.AdamW(lm.parameters(), lr=1e-2)

    ref_opt = step(ref, x_BQ, y_BQ)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt = step(model, *hooks.shard_batch(x_BQ, y_BQ))
    hooks.reduce_gradients(model)
    norm = hooks.clip_grad_norm_(model.parameters(), 0.5)
    assert_close(norm, ref_norm, msg="global grad norm")
    local = ctx.local_experts(4)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if getattr(p, "expert_parallel", False):
            want = want[local.start:local.stop]
        assert_close(p.grad, want, grad=True, msg=name)
    ref_opt.step()
    opt.step()
    model_state, opt_state = hooks.full_states(model, opt)
    for name, value in ref.state_dict().items():
        assert_close(model_state.state_dict()[name], value, grad=True, msg=name)
    for i, state in ref_opt.state_dict()["state"].items():
        for key, value in state.items():
            assert_close(opt_state.state_dict()["state"][i][key], value, grad=True,
                         msg=f"optimizer state {i} {key}")
    # a full (one-process) state loads into the sharded model and optimizer by slicing
    hooks.load_states(model, opt, ref.state_dict(), ref_opt.state_dict())
    for name, p in model.named_parameters():
        want = ref_params[name]
        if getattr(p, "expert_parallel", False):
            want = want[local.start:local.stop]
        torch.testing.assert_close(p.detach(), want.detach(), atol=0, rtol=0)


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    ctx = build_context(world_size)
    E = 4
    even, uneven = [6, 6], [5, 8]
    eq = functools.partial(_equals_single_process, ctx)
    return run_scenarios({
        "all_to_all_moves_rows_and_grads": lambda: _all_to_all_moves_rows_and_grads(ctx),
        "balanced": lambda: eq(uneven, E, _balanced),
        "one_rank_receives_all": lambda: eq(even, E, _to_rank0),
        "rank_sends_none": lambda: eq([7, 0], E, _balanced),
        "padding_sentinels": lambda: eq(uneven, E, _with_padding, num_chunks=2,
                                        recompute="experts"),
        "c_greater_than_T": lambda: eq([3, 2], E, _balanced, num_chunks=4, recompute="experts"),
        "chunked_equals_unchunked": lambda: _chunked_equals_unchunked(ctx, uneven, E, _to_rank0),
        "recompute_reuses_counts": lambda: _recompute_reuses_counts(ctx, E),
        "budget_same_c_on_every_rank": lambda: _budget_agreement(ctx, even, E),
        "chunk_count_mismatch": lambda: _chunk_count_mismatch(ctx, E),
        "lm_step_equals_single_process": lambda: _lm_step_equals_single_process(
            ctx, ChunkConfig(num_chunks=2, recompute="experts")),
        "timeout_is_an_error": lambda: _timeout_is_an_error(ctx),
    })


TWO_RANK_SCENARIOS = ["all_to_all_moves_rows_and_grads", "balanced", "one_rank_receives_all",
                      "rank_sends_none",
                      "padding_sentinels", "c_greater_than_T", "chunked_equals_unchunked",
                      "recompute_reuses_counts",
                      "budget_same_c_on_every_rank", "chunk_count_mismatch",
                      "lm_step_equals_single_process", "timeout_is_an_error"]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_two_ranks, 2, tmp_path_factory.mktemp("ep2"))


@pytest.mark.parametrize("scenario", TWO_RANK_SCENARIOS)
def test_two_ranks(two_rank_results: list[dict[str, Any]], scenario: str) -> None:
    values = check_outcome(two_rank_results, scenario)
    if scenario == "budget_same_c_on_every_rank":
        assert values == [4, 4]


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    ctx = build_context(world_size)
    E = 8
    eq = functools.partial(_equals_single_process, ctx)
    return run_scenarios({
        "balanced": lambda: eq([3, 5, 0, 4], E, _balanced),
        "one_rank_receives_all": lambda: eq([4, 4, 4, 4], E, _to_rank0, num_chunks=2,
                                            recompute="experts"),
        "ep2_dp2_lm_step": lambda: _lm_step_equals_single_process(build_context(2),
                                                                  ChunkConfig()),
    })


@pytest.mark.slow
def test_four_ranks(tmp_path: Any) -> None:
    results = spawn(_four_ranks, 4, tmp_path)
    for scenario in ("balanced", "one_rank_receives_all", "ep2_dp2_lm_step"):
        check_outcome(results, scenario)


def test_experts_not_divisible_by_ep_size() -> None:
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible by the "
                                         r"expert-parallel size ep=4"):
        check_expert_sharding(6, 4)
    fake = ParallelContext(rank=0, world_size=4, ep_size=4, ep_rank=0, ep_group=None,
                           expert_dp_group=None, timeout_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_experts=6"):
        ExpertParallelExperts(_moe(6), fake)

