"""Token-chunked expert execution equals the unchunked run; the skew-peak case (a bug-report case).

Chunked vs unchunked in fp32: outputs and every gradient within ``CHUNKED_ATOL``, absolute and
relative. The grouped GEMMs of a chunk have fewer rows, and the CPU kernels block the reduction
differently for different row counts, so per-row results differ by a few ulps (a value of size m
by ~m·2^-23 each; measured worst: 1.9e-6 on a routing-weight gradient of 5.5, i.e. 3.5e-7
relative). Expert weight gradients are summed chunk by chunk in another order: see
``tolerances.assert_chunked_close``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfine.config import ChunkConfig, MoEConfig
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from memfine.measure.peak import PeakMemoryTracker
from memfine.memory import layer as layer_memory
from memfine.nn import GroupedExperts, MoELayer
from memfine.schedule.chunked import chunk_sizes, run_chunked
from tolerances import assert_chunked_close

pytestmark = pytest.mark.usefixtures("one_thread")
D, N, E, K = 16, 24, 6, 2


def _inputs(T: int, sentinel_every: int = 0) -> list[torch.Tensor]:
    """x, top_k_index (distinct experts per slot; optional sentinel slots), w, w_up, w_down."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g)
    idx = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    if sentinel_every:
        idx[::sentinel_every, 1] = E  # padding / remote slot: contributes 0
    w = torch.rand(T, K, generator=g)
    w_up = torch.randn(E, D, 2 * N, generator=g) * D ** -0.5
    w_down = torch.randn(E, N, D, generator=g) * N ** -0.5
    return [x, idx, w, w_up, w_down]


def chunked_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, *, moe: MoEConfig,
                    **kwargs: object) -> torch.Tensor:
    """:class:`GroupedExperts` over c chunks with the given weights (their autograd leaves)."""
    experts = GroupedExperts(moe)
    return torch.func.functional_call(experts, {"w_up": w_up, "w_down": w_down},
                                      (x, top_k_index, top_k_weights), kwargs)


def _run(inputs: list[torch.Tensor], num_chunks: int | None, recompute: str, impl: str
         ) -> list[torch.Tensor]:
    """(out, dx, dweights, dw_up, dw_down); num_chunks=None is the plain unchunked op."""
    x, idx, w, w_up, w_down = (t.clone() for t in inputs)
    leaves = [t.requires_grad_(True) for t in (x, w, w_up, w_down)]
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K, experts_impl=impl)
    if num_chunks is None:
        out = run_experts(x, w, build_routing_index(idx, E), w_up, w_down, impl=impl)
    else:
        out = chunked_experts(x, idx, w, w_up, w_down, moe=moe, num_chunks=num_chunks,
                              recompute=recompute)  # type: ignore[arg-type]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=False)
    return [out.detach(), *grads]


@pytest.mark.parametrize(("T", "c"), [
    pytest.param(37, 1, id="c1"),
    pytest.param(37, 2, id="c2_T_not_divisible_by_c"),
    pytest.param(37, 3, id="c3_T_not_divisible_by_c"),
    pytest.param(37, 4, id="c4_T_not_divisible_by_c"),
    pytest.param(40, 8, id="c8"),
    pytest.param(5, 8, id="c_greater_than_T"),
    pytest.param(1, 3, id="T1"),
])
@pytest.mark.parametrize("recompute", ["none", "experts"])  # "full" takes the "experts" branch
@pytest.mark.parametrize("impl", ["fused", "plain"])
def test_chunked_equals_unchunked(T: int, c: int, recompute: str, impl: str) -> None:
    inputs = _inputs(T, sentinel_every=3)
    want = _run(inputs, None, "none", impl)
    got = _run(inputs, c, recompute, impl)
    names = ["out", "grad_x", "grad_weights", "grad_w_up", "grad_w_down"]
    for name, a, b in zip(names, got, want, strict=True):
        assert_chunked_close(a, b, name)


def test_single_chunk_is_bitwise_the_unchunked_op() -> None:
    inputs = _inputs(29)
    for a, b in zip(_run(inputs, 1, "experts", "fused"), _run(inputs, None, "none", "fused"),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recompute", ["none", "experts"])
def test_empty_batch_gives_zero_weight_grads(recompute: str) -> None:
    x, idx, w, w_up, w_down = _inputs(0)
    w_up.requires_grad_(True)
    w_down.requires_grad_(True)
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    out = chunked_experts(x, idx, w, w_up, w_down, moe=moe, num_chunks=4,
                          recompute=recompute)  # type: ignore[arg-type]
    assert out.shape == (0, D)
    out.sum().backward()
    assert w_up.grad is not None and w_down.grad is not None
    assert torch.equal(w_up.grad, torch.zeros_like(w_up))
    assert torch.equal(w_down.grad, torch.zeros_like(w_down))


@pytest.mark.parametrize(("T", "c", "sizes"), [
    (10, 1, [10]), (10, 3, [4, 3, 3]), (10, 4, [3, 3, 2, 2]), (3, 5, [1, 1, 1, 0, 0]),
    (0, 2, [0, 0]),
])
def test_chunk_sizes(T: int, c: int, sizes: list[int]) -> None:
    assert chunk_sizes(T, c) == sizes
    assert [len(p) for p in torch.tensor_split(torch.arange(T), c)] == sizes


def test_backward_recomputes_one_chunk_at_a_time() -> None:
    """Each chunk function runs once in forward and once more, alone, in backward."""
    calls: list[tuple[str, int]] = []
    w_up = torch.randn(E, D, 2 * N, requires_grad=True)

    def chunk_fn(chunk: int, x_CD: torch.Tensor, idx_CK: torch.Tensor, w_CK: torch.Tensor
                 ) -> torch.Tensor:
        calls.append(("grad" if torch.is_grad_enabled() else "nograd", x_CD.shape[0]))
        assert x_CD.shape[0] == (4 if chunk == 0 else 3)  # the chunk index comes in order
        return torch.tanh(x_CD @ w_up[0, :, :D]) * w_CK.sum(-1, keepdim=True)

    x = torch.randn(10, D, requires_grad=True)
    w = torch.rand(10, K, requires_grad=True)
    out = run_chunked(chunk_fn, x, torch.zeros(10, K, dtype=torch.long), w, num_chunks=3,
                      recompute="experts")
    assert [n for _, n in calls] == [4, 3, 3]
    out.sum().backward()
    assert [n for _, n in calls] == [4, 3, 3, 3, 3, 4]  # reverse order, one chunk each


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_chunks": 2, "recompute": "all"}, "recompute must be one of"),
    ({"num_chunks": 0, "recompute": "none"}, "num_chunks must be >= 1"),
])
def test_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    x, idx, w, w_up, w_down = _inputs(4)
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match=message):
        chunked_experts(x, idx, w, w_up, w_down, moe=moe, **kwargs)  # type: ignore[arg-type]


def test_rejects_mismatched_routing_shape() -> None:
    x, idx, w, w_up, w_down = _inputs(4)
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match=r"top_k_weights must be \(T, k\)"):
        chunked_experts(x, idx, w[:, :1], w_up, w_down, moe=moe, num_chunks=2)


# --- case skew-peak (the bug-report cases) ----------------------------------------------------
SKEW_T, SKEW_D, SKEW_N, SKEW_E, SKEW_K, SKEW_ROWS = 4096, 64, 256, 8, 2, 512
# Every check of the case carries its id, so ``pytest -k skew-peak`` runs them all.
SkewRuns = dict[str, tuple[torch.Tensor, int, int, int, torch.Tensor]]
SKEW_CASE = pytest.mark.parametrize("case", [pytest.param("skew-peak", id="skew-peak")])


class _LargestRows(TorchDispatchMode):
    """Largest first dimension of any tensor an op materialises (views and in-place results of
    existing storages are skipped), leaving out the T-row tensors of the layer interface (its
    input/output, their gradients and the gradient accumulation)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != self.num_tokens
                    and t.untyped_storage()._cdata not in inputs):
                self.largest = max(self.largest, int(t.shape[0]))
        return out


def _skew_layer(chunk: ChunkConfig) -> MoELayer:
    # Experiment knob: a selection bias of 2 on experts 0 and 1 sends every token to {0, 1}.
    moe = MoEConfig(hidden_size=SKEW_D, intermediate_size=SKEW_N, num_experts=SKEW_E,
                    top_k=SKEW_K, skew_hot_experts=2, skew_bias=2.0)
    torch.manual_seed(0)
    return MoELayer(moe, chunk=chunk)


def _skew_budget() -> tuple[int, ChunkConfig]:
    """The exact predicted peak at c = 16 (512 received rows per chunk): MACT picks c = 16."""
    moe = MoEConfig(hidden_size=SKEW_D, intermediate_size=SKEW_N, num_experts=SKEW_E,
                    top_k=SKEW_K)
    budget = layer_memory.layer_peak_bytes(moe, SKEW_T, 4, num_chunks=16, recompute="experts")
    return budget, ChunkConfig(memory_budget_bytes=budget, bins=(1, 2, 4, 8, 16),
                               recompute="experts")


def _measure(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor
             ) -> tuple[torch.Tensor, int, int, int, torch.Tensor]:
    """(out, num_chunks, bytes alive after forward without the output, peak bytes, dx).

    Protocol of the memory model: x exists before and requires grad, the parameters have no
    ``.grad`` (their gradients are created, and counted, in backward); backward runs from the
    output, the load-balancing loss and the z-loss, with gradients that exist before.
    """
    x = x.detach().requires_grad_(True)
    one = torch.ones(())
    with PeakMemoryTracker() as tracker:
        out, aux = layer(x)
        kept = tracker.mark("forward") - out.untyped_storage().nbytes()
        torch.autograd.backward([out, aux.load_balancing_loss, aux.z_loss], [grad_out, one, one])
    assert torch.equal(aux.tokens_per_expert, torch.tensor([SKEW_T] * 2 + [0] * 6))
    return out.detach(), aux.num_chunks, kept, tracker.peak_bytes, x.grad


def _largest_expert_rows(x: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor,
                         layer: MoELayer, num_chunks: int) -> int:
    """Largest intermediate row count of the chunked expert part's forward + backward."""
    x = x.detach().requires_grad_(True)
    weights = weights.detach().requires_grad_(True)
    with _LargestRows(x.shape[0]) as mode:
        out = chunked_experts(x, top_k_index, weights, layer.experts.w_up, layer.experts.w_down,
                              moe=layer.config, num_chunks=num_chunks, recompute="experts")
        out.backward(torch.ones_like(out))
    return mode.largest


@SKEW_CASE
def test_skew_peak_rows(case: str) -> None:
    """skew-peak: no materialised expert intermediate has more than 512 rows (fwd + bwd)."""
    layer = _skew_layer(_skew_budget()[1])
    x = torch.randn(SKEW_T, SKEW_D)
    with torch.no_grad():
        routing = layer.router(x)
    c = layer.policy.num_chunks(layer.experts.received_rows(routing.top_k_index), SKEW_T,
                                 4)
    assert c == 16
    # The detector sees the expert rows: unchunked, 64 tokens give 128-row intermediates.
    assert _largest_expert_rows(x[:64], routing.top_k_index[:64], routing.top_k_weights[:64],
                                layer, num_chunks=1) == 64 * SKEW_K
    largest = _largest_expert_rows(x, routing.top_k_index, routing.top_k_weights, layer, c)
    assert largest <= SKEW_ROWS, largest


@pytest.fixture(scope="module")
def skew_runs() -> SkewRuns:
    """The skew-peak layer under the 512-row budget, and two unchunked runs, measured once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _skew_runs()
    finally:
        torch.set_num_threads(threads)


def _skew_runs() -> SkewRuns:
    torch.manual_seed(0)
    x = torch.randn(SKEW_T, SKEW_D)
    grad_out = torch.randn(SKEW_T, SKEW_D)
    chunks = {"budget": _skew_budget()[1],
              "none_c1": ChunkConfig(num_chunks=1, recompute="none"),
              "experts_c1": ChunkConfig(num_chunks=1, recompute="experts")}
    return {name: _measure(_skew_layer(chunk), x, grad_out) for name, chunk in chunks.items()}


@SKEW_CASE
def test_skew_peak_output(case: str, skew_runs: SkewRuns) -> None:
    """skew-peak: the output and dx equal the unchunked reference; 16 chunks were used."""
    out, c, _, _, dx = skew_runs["budget"]
    ref_out, ref_c, _, _, ref_dx = skew_runs["none_c1"]
    assert (c, ref_c) == (16, 1)
    assert_chunked_close(out, ref_out, "out")
    assert_chunked_close(dx, ref_dx, "grad_x")


@SKEW_CASE
def test_skew_peak_saved_bytes(case: str, skew_runs: SkewRuns) -> None:
    """skew-peak: what survives forward does not grow with the received rows.

    Without recompute every row's H (S·G fp32, S = T·k = 8192) is kept; with chunked recompute
    none is, whatever c: only the routing survives, and it is less than one 512-row chunk's H.
    """
    kept = skew_runs["budget"][2]
    kept_none, kept_c1 = skew_runs["none_c1"][2], skew_runs["experts_c1"][2]
    assert kept_none >= SKEW_T * SKEW_K * 2 * SKEW_N * 4
    assert kept == kept_c1
    assert kept < SKEW_ROWS * 2 * SKEW_N * 4


@SKEW_CASE
def test_skew_peak_within_budget(case: str, skew_runs: SkewRuns) -> None:
    """skew-peak: the measured peak of forward + backward stays within the budget."""
    budget = _skew_budget()[0]
    peak = skew_runs["budget"][3]
    assert peak <= budget, f"measured peak {peak} bytes > budget {budget} bytes"


def test_no_grad_runs_chunks_without_checkpoint() -> None:
    """Inference (no autograd) runs the chunks plainly and gives the same output."""
    x, idx, w, w_up, w_down = _inputs(23)
    moe = MoEConfig(hidden_size=D, intermediate_size=N, num_experts=E, top_k=K)
    with torch.no_grad():
        got = chunked_experts(x, idx, w, w_up, w_down, moe=moe, num_chunks=4)
    want = run_experts(x, w, build_routing_index(idx, E), w_up, w_down)
    assert_chunked_close(got, want.detach(), "out")
