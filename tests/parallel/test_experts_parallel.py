"""Expert parallelism over gloo: equal to one process on the concatenated batch.

Covers the EP experts (memfine.parallel.experts, notify, all_to_all), the sharded model
(FSDP2 + experts over ``ep``: gradients, DTensor-aware clipping, the optimizer step) and the aux
losses over the global valid tokens. One spawn of 2 processes runs every scenario in the same
process group, each scenario its own pytest case through a module-scoped fixture; a 4-process
spawn (ep 4, and dp_shard 2 × ep 2) is marked slow.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ep_harness import check_outcome, run_scenarios, spawn
from torch.distributed.tensor import DTensor

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.measure.peak import PeakMemoryTracker
from memfine.nn import MoELayer, MoETransformerLM
from memfine.parallel import (
    ExpertParallelExperts,
    ParallelContext,
    all_to_all,
    build_context,
    check_expert_sharding,
    check_layout,
    exchange_counts,
)
from memfine.parallel import collectives as collectives_mod
from memfine.parallel import experts as experts_mod
from memfine.parallel.training import DistributedTraining
from memfine.schedule import policy as policy_mod
from memfine.schedule.chunked import chunk_sizes
from memfine.schedule.decision import ChunkRows, chunk_rows_of
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
    policy = policy or ChunkPolicy(ChunkConfig(num_chunks=num_chunks, recompute=recompute),
                                   _moe(E))
    out, plan = module.run(x_l, idx[start:stop], w_l, policy)
    (out * grad_out[start:stop]).sum().backward()
    got = {"out": out, "x": x_l.grad, "w": w_l.grad, "w_up": _local(module.w_up.grad),
           "w_down": _local(module.w_down.grad)}
    want = {"out": ref[start:stop], "x": leaves[0].grad[start:stop],
            "w": leaves[1].grad[start:stop], "w_up": leaves[2].grad[local.start:local.stop],
            "w_down": leaves[3].grad[local.start:local.stop]}
    return got, want, plan.num_chunks


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


def _ep_peak_bytes(ctx: ParallelContext, num_chunks: int, recompute: str) -> int:
    """This rank's peak live bytes of one EP forward + backward (weights 4× the activations)."""
    E, d, n, T = 4, 32, 64, 8
    moe = MoEConfig(hidden_size=d, intermediate_size=n, num_experts=E, top_k=K)
    g = torch.Generator().manual_seed(11)
    module = ExpertParallelExperts.from_full(torch.randn(E, d, 2 * n, generator=g),
                                             torch.randn(E, n, d, generator=g), moe, ctx)
    x_TD = torch.randn(T, d, generator=g).requires_grad_()
    w_TK = torch.rand(T, K, generator=g).requires_grad_()
    policy = ChunkPolicy(ChunkConfig(num_chunks=num_chunks, recompute=recompute), moe)
    with PeakMemoryTracker("cpu") as tracker:
        out, _ = module.run(x_TD, _to_rank0(T, E, g), w_TK, policy)
        out.sum().backward()
        del out
    return tracker.peak_bytes


def _chunked_peak_not_above_unchunked(ctx: ParallelContext) -> list[int]:
    """c = 4 with recompute shares one weight-gradient buffer per weight across the chunks: its
    peak stays at or below the unchunked one; summing c chunk gradients (no shared buffer)
    would hold two weight-gradient-sized tensors at once and exceed it."""
    unchunked = _ep_peak_bytes(ctx, 1, "none")
    chunked = _ep_peak_bytes(ctx, 4, "experts")
    share = experts_mod.share_chunk_weight_grads
    experts_mod.share_chunk_weight_grads = lambda weights, c, **_: (weights, None)
    try:
        summed = _ep_peak_bytes(ctx, 4, "experts")
    finally:
        experts_mod.share_chunk_weight_grads = share
    assert chunked <= unchunked < summed, (chunked, unchunked, summed)
    return [chunked, unchunked, summed]


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


def _hot_rows(tokens: list[int], E: int, bins: tuple[int, ...]) -> ChunkRows:
    """The chunks' rows of rank 0 under :func:`_to_rank0` routing: it sends its own C·k rows
    per chunk and receives every rank's (known on every rank without an exchange)."""
    rows = {c: tuple((sizes[0] * K, sum(sizes) * K) for sizes in zip(
        *(chunk_sizes(t, c) for t in tokens), strict=True)) for c in bins}
    return ChunkRows(local_experts=E // len(tokens), rows=rows)


def _budget_agreement(ctx: ParallelContext, tokens: list[int], E: int) -> int:
    """A budget that needs c=4 on the hot rank and c=1 elsewhere: every rank runs c=4."""
    moe = _moe(E)
    probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
    transport = ExpertParallelExperts(moe, ctx).transport_row_elements  # received x rows: d
    assert transport == moe.hidden_size
    T, rows_hot = tokens[ctx.rank], sum(tokens) * K
    budget = probe.predicted_peak(rows_hot, T, 4, 4,  # the hot rank's prediction at c=4
                                  chunk_rows=_hot_rows(tokens, E, probe.config.bins))
    chunk = ChunkConfig(memory_budget_bytes=budget, recompute="experts")
    local_policy = ChunkPolicy(chunk, moe)  # identity agreement: this rank's own choice
    idx = _to_rank0(T, E, torch.Generator())
    counts = exchange_counts(idx, E, chunk.bins, ctx.ep_group)
    recv, rows = counts.recv_tokens, chunk_rows_of(counts)
    own = local_policy.num_chunks(recv, T, 4, transport_row_elements=transport, chunk_rows=rows)
    fits = [c for c in chunk.bins if probe.predicted_peak(
        recv, T, 4, c, transport_row_elements=transport, chunk_rows=rows) <= budget]
    assert own == fits[0] and (own == 4 if ctx.ep_rank == 0 else own < 4), (own, recv)
    policy = ChunkPolicy(chunk, moe)  # the EP experts pass their own agreement
    calls = {"all_reduce": 0}
    all_reduce = collectives_mod.dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    collectives_mod.dist.all_reduce = counting_all_reduce
    try:
        got, want, c = _case(ctx, tokens, E, _to_rank0, policy=policy)
    finally:
        collectives_mod.dist.all_reduce = all_reduce
    assert calls == {"all_reduce": 1}, calls  # ONE all-reduce MAX per budgeted call
    for name in got:
        assert_close(got[name], want[name], msg=name)
    return c


def _budget_row_blocks(ctx: ParallelContext, tokens: list[int], E: int) -> list[int]:
    """A budget the hot rank meets at c = 1 only with smaller row blocks: every rank runs
    c = 1, the hot rank its largest fitting block (a ladder of 8, 4, 2 rows stands in for the
    device's sizes), and the results equal the single process."""
    moe = _moe(E)
    ladder = (8, 4, 2)
    real, run = policy_mod.ladder_block_rows, experts_mod.run_experts
    policy_mod.ladder_block_rows = lambda moe, dt, device: ladder  # type: ignore[assignment]
    blocks: list[object] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        blocks.append(kwargs.get("block_rows"))
        return run(*args, **kwargs)

    experts_mod.run_experts = spy
    try:
        probe = ChunkPolicy(ChunkConfig(memory_budget_bytes=1, recompute="experts"), moe)
        T, rows_hot = tokens[ctx.rank], sum(tokens) * K
        hot_rows = _hot_rows(tokens, E, probe.config.bins)

        def hot(block: int) -> int:
            return probe.predicted_peak(rows_hot, T, 4, 1, block_rows=block,
                                        chunk_rows=hot_rows)

        budget = hot(ladder[-1])
        assert hot(ladder[0]) > budget
        policy = ChunkPolicy(ChunkConfig(memory_budget_bytes=budget, recompute="experts"), moe)
        got, want, c = _case(ctx, tokens, E, _to_rank0, policy=policy)
    finally:
        policy_mod.ladder_block_rows, experts_mod.run_experts = real, run
    for name in got:
        assert_close(got[name], want[name], msg=name)
    decision = policy.last_decision
    assert decision is not None and decision.num_chunks == c
    assert blocks and set(blocks) == {decision.block_rows}, blocks  # the rank's own blocks
    return [c, ladder.index(decision.block_rows)]


def _chunk_count_mismatch(ctx: ParallelContext, E: int) -> None:
    """Ranks asked for different fixed c: every rank raises (none waits for a missing chunk)."""
    g = torch.Generator().manual_seed(0)
    module = ExpertParallelExperts.from_full(torch.zeros(E, D, 2 * N), torch.zeros(E, N, D),
                                             _moe(E), ctx)
    policy = ChunkPolicy(ChunkConfig(num_chunks=1 + ctx.rank, recompute="none"), _moe(E))
    with pytest.raises(ValueError, match="different chunk counts"):
        module.run(torch.randn(4, D, generator=g), _balanced(4, E, g), torch.rand(4, K), policy)


def _timeout_is_an_error(ctx: ParallelContext) -> None:
    """A rank that skips a collective makes the others fail after the group timeout."""
    group = dist.new_group(list(range(ctx.world_size)), timeout=datetime.timedelta(seconds=2))
    if ctx.rank == 0:
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()


def _lm_step_equals_single_process(ctx: ParallelContext, chunk: ChunkConfig) -> None:
    """One training step of the LM sharded with FSDP2 + experts over ``ep``: every gradient, the
    clipped global norm and every parameter after AdamW equal one process on the whole batch.

    The load-balancing loss (global-batch f, token-weighted P) and the z-loss are both on.
    """
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    config = ModelConfig(num_layers=2, num_heads=2, max_seq_len=16, moe=moe, chunk=chunk)
    torch.manual_seed(0)
    ref = MoETransformerLM(config)
    torch.manual_seed(0)
    model = MoETransformerLM(config)
    hooks = DistributedTraining(ctx)
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
    norm = hooks.clip_grad_norm_(model.parameters(), 0.5)
    assert_close(norm, ref_norm, msg="global grad norm")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), name  # FSDP2 reduced it; nothing by hand
        assert_close(p.grad.full_tensor(), ref_params[name].grad, grad=True, msg=name)
    ref_opt.step()
    opt.step()
    for name, p in model.named_parameters():
        assert_close(p.detach().full_tensor(), ref_params[name].detach(), grad=True, msg=name)


def _aux_over_global_tokens(ctx: ParallelContext, **routing: Any) -> list[float]:
    """8 valid tokens on rank 0, 2 on rank 1 (the rest padding), E = 4, k = 2: the mean over
    the ranks of the balancing loss, the z-loss and the router gradient equal one process
    holding the 10 valid tokens. ``routing``: extra MoEConfig fields (e.g. a capacity factor:
    the losses count the selection before drops, so they still equal one process)."""
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=4, top_k=K, **routing)
    torch.manual_seed(3)
    ref = MoELayer(moe)
    layer = MoELayer(moe)
    layer.load_state_dict(ref.state_dict())
    layer.experts = ExpertParallelExperts.from_full(ref.experts.w_up, ref.experts.w_down, moe,
                                                    ctx)
    g = torch.Generator().manual_seed(7)
    x_2TD = torch.randn(2, 10, D, generator=g) * 3
    valid = [8, 2]
    _, ref_aux = ref(torch.cat([x_2TD[0, :8], x_2TD[1, :2]]))
    (ref_aux.load_balancing_loss + ref_aux.z_loss).backward()
    mask_T = torch.arange(10) < valid[ctx.rank]
    _, aux = layer(x_2TD[ctx.rank], mask_T)
    (aux.load_balancing_loss + aux.z_loss).backward()
    got = torch.stack([aux.load_balancing_loss.detach(), aux.z_loss.detach()])
    dist.all_reduce(got)  # mean over the ranks, as data-parallel averaging does
    grad = layer.router.weight.grad.clone()
    dist.all_reduce(grad)
    assert_close(got / 2, torch.stack([ref_aux.load_balancing_loss, ref_aux.z_loss]).detach(),
                 msg="balancing loss, z-loss")
    assert_close(grad / 2, ref.router.weight.grad, grad=True, msg="router gradient")
    return [float(v) for v in got / 2]


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    ctx = build_context(1, world_size)
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
        "chunked_peak_not_above_unchunked": lambda: _chunked_peak_not_above_unchunked(ctx),
        "recompute_reuses_counts": lambda: _recompute_reuses_counts(ctx, E),
        "budget_same_c_on_every_rank": lambda: _budget_agreement(ctx, even, E),
        "budget_shrinks_row_blocks": lambda: _budget_row_blocks(ctx, even, E),
        "chunk_count_mismatch": lambda: _chunk_count_mismatch(ctx, E),
        "lm_step_equals_single_process": lambda: _lm_step_equals_single_process(
            ctx, ChunkConfig(num_chunks=2, recompute="experts")),
        "lm_step_dp_shard_2": lambda: _lm_step_equals_single_process(
            build_context(2, 1), ChunkConfig(memory_budget_bytes=2**20, recompute="experts")),
        "aux_over_global_tokens": lambda: _aux_over_global_tokens(ctx),
        "aux_over_global_tokens_with_capacity": lambda: _aux_over_global_tokens(
            ctx, capacity_factor=0.5),
        "timeout_is_an_error": lambda: _timeout_is_an_error(ctx),
    })


TWO_RANK_SCENARIOS = ["all_to_all_moves_rows_and_grads", "balanced", "one_rank_receives_all",
                      "rank_sends_none",
                      "padding_sentinels", "c_greater_than_T", "chunked_equals_unchunked",
                      "chunked_peak_not_above_unchunked",
                      "recompute_reuses_counts",
                      "budget_same_c_on_every_rank", "budget_shrinks_row_blocks",
                      "chunk_count_mismatch",
                      "lm_step_equals_single_process", "lm_step_dp_shard_2",
                      "aux_over_global_tokens", "aux_over_global_tokens_with_capacity",
                      "timeout_is_an_error"]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_two_ranks, 2, tmp_path_factory.mktemp("ep2"))


@pytest.mark.parametrize("scenario", TWO_RANK_SCENARIOS)
def test_two_ranks(two_rank_results: list[dict[str, Any]], scenario: str) -> None:
    values = check_outcome(two_rank_results, scenario)
    if scenario == "budget_same_c_on_every_rank":
        assert values == [4, 4]
    if scenario == "budget_shrinks_row_blocks":  # [c, block index in the ladder] per rank
        assert values[0][0] == values[1][0] == 1
        assert values[0][1] > 0 and values[1][1] == 0  # the idle rank keeps the largest block
    if scenario == "aux_over_global_tokens":
        assert values[0] == values[1]  # every rank reports the global value


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    ctx = build_context(1, world_size)
    E = 8
    eq = functools.partial(_equals_single_process, ctx)
    return run_scenarios({
        "balanced": lambda: eq([3, 5, 0, 4], E, _balanced),
        "one_rank_receives_all": lambda: eq([4, 4, 4, 4], E, _to_rank0, num_chunks=2,
                                            recompute="experts"),
        # experts FSDP-sharded over dp_shard = 2, c = 2 chunks sharing their weight-gradient
        # buffers across FSDP2's reshard and re-gather (recompute reads the re-gathered weights)
        "ep2_dp2_lm_step": lambda: _lm_step_equals_single_process(
            build_context(2, 2), ChunkConfig(num_chunks=2, recompute="experts")),
        "ep4_lm_step": lambda: _lm_step_equals_single_process(ctx, ChunkConfig()),
        "dp4_lm_step": lambda: _lm_step_equals_single_process(build_context(4, 1),
                                                              ChunkConfig()),
    })


@pytest.mark.slow
def test_four_ranks(tmp_path: Any) -> None:
    results = spawn(_four_ranks, 4, tmp_path)
    for scenario in ("balanced", "one_rank_receives_all", "ep2_dp2_lm_step", "ep4_lm_step",
                     "dp4_lm_step"):
        check_outcome(results, scenario)


def test_experts_not_divisible_by_ep_size() -> None:
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible by the "
                                         r"expert-parallel size ep=4"):
        check_expert_sharding(6, 4)
    fake = ParallelContext(mesh=None, dp_mesh=None, rank=0, world_size=4, dp_shard=1,  # type: ignore[arg-type]
                           ep_size=4, ep_rank=0)
    with pytest.raises(ValueError, match="num_experts=6"):
        ExpertParallelExperts(_moe(6), fake)


@pytest.mark.parametrize(("world", "dp_shard", "ep", "message"), [
    (4, 2, 1, r"world size 4 must equal --dp-shard × --ep, got 2 × 1 = 2"),
    (2, 0, 2, r"--dp-shard must be an int >= 1, got 0"),
    (2, 1, -1, r"--ep must be an int >= 1, got -1"),
])
def test_bad_layout(world: int, dp_shard: int, ep: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_layout(world, dp_shard, ep)

