"""torch.compile of MoELayer and MoETransformerLM: equal to eager, documented graph breaks,
no recompilation when other experts are empty (docs/compile.md).

Inductor compiles take tens of seconds on a CPU, so the default suite compiles a few
configurations with inductor and the rest with ``aot_eager`` (the same Dynamo graph and AOT
autograd, without inductor's code generation); ``-m slow`` runs every case with inductor.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._dynamo.variables.tensor import TensorVariable

from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.experts import function as fused_function
from memfine.nn import MoELayer, MoETransformerLM
from memfine.schedule import InfeasibleBudgetError, traced
from tolerances import assert_close

DOCS = Path(__file__).parents[2] / "docs" / "compile.md"
MOE = MoEConfig(hidden_size=16, intermediate_size=32, num_experts=4, top_k=2)
BUDGET = ChunkConfig(memory_budget_bytes=36_000)  # MACT picks c = 4 for T = 16 (fp32)
C3 = ChunkConfig(num_chunks=3, recompute="experts")

# Graph-break sites of a compiled MoELayer under dynamo.explain, as docs/compile.md lists them
# (capture_scalar_outputs on). A new break must be documented there and counted here.
DOCUMENTED_BREAKS = {"c1": 0, "c3-recompute": 0, "c3-none": 0, "plain": 0, "budget": 0,
                     "biased": 0, "groups-capacity": 0, "shared-seq": 0, "c1-blocks": 0}
# Streamed fused backward in blocks of 12 rows: one row costs (3·d + 3·n + 2·n)·4 = 832 bytes,
# so S ≤ T·k = 32 rows are 3 blocks (12, 12, 8), traced over the bound T·k.
BLOCKS = MoEConfig(**{**MOE.to_dict(), "backward_block_bytes": 12 * 832})
ROUTING_CASES = {  # routing options: selection bias; groups + capacity; shared experts + L_seq
    "biased": {"skew_hot_experts": 1, "skew_bias": 0.05},
    "groups-capacity": {"score_func": "sigmoid", "n_group": 2, "topk_group": 1,
                        "routed_scaling_factor": 2.5, "capacity_factor": 1.0},
    "shared-seq": {"num_shared_experts": 1, "shared_expert_gate": True,
                   "seq_aux_loss_coef": 0.01},
}
LAYER_CASES = {
    "c1": (MOE, None),
    "c3-recompute": (MOE, C3),
    "c3-none": (MOE, ChunkConfig(num_chunks=3, recompute="none")),
    "plain": (MoEConfig(**{**MOE.to_dict(), "experts_impl": "plain"}), None),
    "budget": (MOE, BUDGET),
    "c1-blocks": (BLOCKS, None),
    **{name: (MoEConfig(**{**MOE.to_dict(), **options}), None)
       for name, options in ROUTING_CASES.items()},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    dynamo.reset()
    counters.clear()


def _layer(case: str, dtype: torch.dtype = torch.float32) -> MoELayer:
    moe, chunk = LAYER_CASES[case]
    return MoELayer(moe, chunk=chunk).to(dtype)


def _step(fn: object, layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    """Forward + backward of out² + aux losses; returns out, aux values and every gradient."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, aux = fn(x)  # type: ignore[operator]
    loss = out.float().square().sum() + aux.load_balancing_loss + aux.z_loss
    loss.backward()
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None for g in grads)
    return [out.detach(), aux.load_balancing_loss.detach(), aux.z_loss.detach(),
            aux.tokens_per_expert, x.grad, *grads]


def _check_equal_to_eager(case: str, dtype: torch.dtype, backend: str, *,
                          capture_scalar_outputs: bool = True,
                          fullgraph: bool | None = None) -> None:
    layer = _layer(case, dtype)
    x = torch.randn(2, 8, MOE.hidden_size, dtype=dtype)
    want = _step(layer, layer, x)
    if fullgraph is None:
        fullgraph = DOCUMENTED_BREAKS[case] == 0
    with dynamo.config.patch(capture_scalar_outputs=capture_scalar_outputs):
        compiled = torch.compile(layer, backend=backend, fullgraph=fullgraph)
        got = _step(compiled, layer, x)
    assert torch.equal(got[3], want[3])  # tokens_per_expert: same routing
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, grad=i >= 4, dtype=dtype, msg=f"{case} tensor {i}")


@pytest.mark.parametrize(("case", "dtype"), [
    # slow-only: c = 1 under inductor is also test_model_compiled_equals_eager[inductor-unchunked]
    pytest.param("c1", torch.float32, id="fp32-c1", marks=pytest.mark.slow),
    pytest.param("c1", torch.bfloat16, id="bf16-c1", marks=pytest.mark.slow),
    pytest.param("c3-recompute", torch.float32, id="fp32-c3-recompute"),
    pytest.param("budget", torch.float32, id="fp32-budget", marks=pytest.mark.slow),
])
def test_layer_inductor_equals_eager(case: str, dtype: torch.dtype) -> None:
    _check_equal_to_eager(case, dtype, "inductor")


@pytest.mark.parametrize(("case", "dtype"), [
    pytest.param("plain", torch.float32, id="fp32-plain"),
    pytest.param("c3-none", torch.bfloat16, id="bf16-c3-none"),
    pytest.param("c1-blocks", torch.float32, id="fp32-c1-blocks"),
])
def test_layer_aot_eager_equals_eager(case: str, dtype: torch.dtype) -> None:
    _check_equal_to_eager(case, dtype, "aot_eager")


@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_options_compile_whole_and_equal_eager(case: str) -> None:
    """Bias, groups, capacity, scaling, shared experts: one graph, eager's values and grads."""
    _check_equal_to_eager(case, torch.float32, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_inductor_equals_eager_all_cases(case: str, dtype: torch.dtype) -> None:
    _check_equal_to_eager(case, dtype, "inductor")


def test_budget_picks_a_chunk_count_above_one() -> None:
    """The budget case exercises MACT: its chunk count is above the trivial c = 1."""
    _, aux = _layer("budget")(torch.randn(2, 8, MOE.hidden_size))
    assert aux.num_chunks == 4


@contextlib.contextmanager
def _dynamo_messages() -> Iterator[list[str]]:
    """Collect what Dynamo logs at WARNING or above and every Python warning, as text.

    Dynamo prints its ``Tensor.item()`` graph-break advice once per process (a cached
    function): the cache is cleared first, so an earlier test cannot hide it.
    """
    TensorVariable._warn_capture_scalar_outputs.cache_clear()
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)


def test_dynamo_message_capture_sees_the_item_graph_break_advice() -> None:
    """The capture of the next test works: an ``.item()`` in a compiled function is reported."""
    with _dynamo_messages() as messages:
        torch.compile(lambda x: x * x.sum().item(), backend="eager")(torch.ones(3))
    assert any("Graph break" in m and "capture_scalar_outputs" in m for m in messages)


@pytest.mark.parametrize("case", ["c1", "c3-recompute", "budget"])
def test_default_compile_is_quiet_and_equals_eager(case: str) -> None:
    """``torch.compile(layer)`` with Dynamo's defaults (no ``fullgraph``, no
    ``capture_scalar_outputs``): no graph-break advice or warning is printed, and the values and
    gradients are eager's (the routed-row count is the ``memfine::routed_slots`` boundary)."""
    with _dynamo_messages() as messages:
        _check_equal_to_eager(case, torch.float32, "aot_eager", capture_scalar_outputs=False,
                              fullgraph=False)
    assert messages == []


def test_fullgraph_without_capture_scalar_outputs_equals_eager() -> None:
    """``fullgraph=True`` alone lets Dynamo trace ``memfine::routed_slots``'s unbacked size."""
    _check_equal_to_eager("c3-recompute", torch.float32, "aot_eager",
                          capture_scalar_outputs=False, fullgraph=True)


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=() if case in ("c1", "budget", "shared-seq")
                 else pytest.mark.slow) for case in DOCUMENTED_BREAKS])
def test_default_compile_breaks_only_at_the_routed_rows(case: str) -> None:
    """Without ``capture_scalar_outputs`` each configuration has one more break site than
    docs/compile.md's table lists: ``routed_slots`` (the routed-row count), and nothing else."""
    reasons, sites = _break_sites(case, capture_scalar_outputs=False)
    at_routed_slots = [r for r in reasons if r.user_stack[-1].name == "routed_slots"]
    assert at_routed_slots
    assert all("memfine.routed_slots" in r.reason for r in at_routed_slots)
    assert len(sites) == DOCUMENTED_BREAKS[case] + 1, sorted(sites)


def _break_sites(case: str, *, capture_scalar_outputs: bool) -> tuple[list[Any], set[str]]:
    """``dynamo.explain``'s break reasons of a layer case, and their distinct user frames."""
    dynamo.reset()
    with dynamo.config.patch(capture_scalar_outputs=capture_scalar_outputs):
        explained = dynamo.explain(_layer(case))(torch.randn(2, 8, MOE.hidden_size))
    return explained.break_reasons, {str(r.user_stack[-1]) for r in explained.break_reasons}


def _documented_breaks() -> dict[str, int]:
    rows = re.findall(r"^\| `(\S+)` \| (\d+) \|", DOCS.read_text(encoding="utf-8"), re.M)
    return {name: int(count) for name, count in rows}


def test_the_documented_break_table_is_this_test_s() -> None:
    assert _documented_breaks() == DOCUMENTED_BREAKS  # docs/compile.md and this test agree


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=() if case == "c1" else pytest.mark.slow)
    for case in DOCUMENTED_BREAKS])
def test_graph_breaks_do_not_exceed_the_documented_number(case: str) -> None:
    """``dynamo.explain`` finds no more break sites than docs/compile.md lists. Every row lists
    0, and the default suite compiles the other cases with ``fullgraph=True`` (which fails on
    any break: the equality, routing, varying-T and budget tests), so they run here with
    ``-m slow`` only."""
    reasons, sites = _break_sites(case, capture_scalar_outputs=True)
    assert len(sites) <= DOCUMENTED_BREAKS[case], (case, [r.reason for r in reasons])


def test_no_recompile_when_other_experts_are_empty() -> None:
    """Steps whose routing leaves different experts empty reuse one graph (S is unbacked)."""
    layer = _layer("c1")
    x = torch.randn(2, 8, MOE.hidden_size)
    seen = []
    with dynamo.config.patch(capture_scalar_outputs=True, error_on_recompile=True):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for hot in ([0, 1], [2, 3], [1, 2], []):
            with torch.no_grad():
                layer.router.selection_bias.zero_()
                layer.router.selection_bias[hot] = 10.0
            out, aux = compiled(x)
            out.sum().backward()
            seen.append(aux.tokens_per_expert.tolist())
    assert seen[0] == [16, 16, 0, 0] and seen[1] == [0, 0, 16, 16] and seen[2] == [0, 16, 16, 0]
    assert counters["stats"]["unique_graphs"] == 1


def _backward_weight_grads(case: str) -> int:
    """Grouped weight-gradient ops in the compiled backward graph of a layer (aot_autograd)."""
    counts: list[int] = []

    def bw_compiler(gm: torch.fx.GraphModule, _: object) -> object:
        counts.append(sum("grouped" in str(n.target) and _is_weight_grad(n)
                          for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           bw_compiler=bw_compiler)
    layer = _layer(case)
    with dynamo.config.patch(capture_scalar_outputs=True):
        _step(torch.compile(layer, backend=backend, fullgraph=True), layer,
              torch.randn(2, 8, MOE.hidden_size))
    (count,) = counts
    return count


def _is_weight_grad(node: torch.fx.Node) -> bool:
    """A grouped GEMM whose output is (E, ·, ·): a weight gradient, not (rows, ·)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 3


def test_compiled_backward_is_one_block_by_default() -> None:
    """The block knob asks for 3 blocks; under compile the backward is one block (w_up and
    w_down: 2 weight-gradient GEMMs), so the graph does not grow with T·k / B."""
    assert _backward_weight_grads("c1") == _backward_weight_grads("c1-blocks") == 2


def test_compiled_backward_streams_row_blocks_when_enabled(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """With STREAM_UNDER_COMPILE the traced backward runs one block per B rows of the bound
    S ≤ T·k: 3 blocks, 3× the weight-gradient GEMMs, and eager's values (MoEBlaze §4.2)."""
    monkeypatch.setattr(fused_function, "STREAM_UNDER_COMPILE", True)
    assert _backward_weight_grads("c1-blocks") == 3 * 2
    dynamo.reset()
    _check_equal_to_eager("c1-blocks", torch.float32, "aot_eager")


def _model(chunk: ChunkConfig) -> MoETransformerLM:
    moe = MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    model = MoETransformerLM(ModelConfig(vocab_size=32, num_layers=2, num_heads=2,
                                         max_seq_len=12, moe=moe, chunk=chunk))
    with torch.no_grad():
        model.embed.weight.normal_()
    return model


def _model_step(fn: object, model: MoETransformerLM, ids: torch.Tensor,
                targets: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = fn(ids, targets)  # type: ignore[operator]
    (out.loss + 0.01 * out.load_balancing_loss + 0.001 * out.z_loss).backward()
    return [out.logits.detach(), out.loss.detach(), *[p.grad for p in model.parameters()]]


@pytest.mark.parametrize(("chunk", "backend"), [
    pytest.param(ChunkConfig(), "inductor", id="inductor-unchunked"),
    pytest.param(ChunkConfig(num_chunks=2, recompute="full"), "aot_eager",
                 id="aot_eager-c2-full-recompute", marks=pytest.mark.slow),
    pytest.param(ChunkConfig(num_chunks=2, recompute="full"), "inductor",
                 id="inductor-c2-full-recompute", marks=pytest.mark.slow),
])
def test_model_compiled_equals_eager(chunk: ChunkConfig, backend: str) -> None:
    model = _model(chunk)
    ids, targets = torch.randint(0, 32, (2, 12)), torch.randint(0, 32, (2, 12))
    want = _model_step(model, model, ids, targets)
    with dynamo.config.patch(capture_scalar_outputs=True):
        got = _model_step(torch.compile(model, backend=backend, fullgraph=True), model, ids,
                          targets)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, grad=i >= 2, msg=f"tensor {i}")


def test_compiled_model_rejects_out_of_range_ids() -> None:
    """The id check becomes an asynchronous assert in the graph (no break): it still raises."""
    model = _model(ChunkConfig())
    with dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        compiled(torch.randint(0, 32, (1, 4)))
        with pytest.raises(RuntimeError, match=r"input_ids must lie in \[0, vocab_size=32\)"):
            compiled(torch.full((1, 4), 32))


# --- varying token counts: the last, shorter batch and evaluation change T -----------------------
VARYING_T = (16, 24, 32, 40)
WIDE_BUDGET = ChunkConfig(memory_budget_bytes=49_500)  # c = 1, 2, 4, 4 for T = 16 … 40


def _assert_steps_equal(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]],
                        case: str) -> None:
    for T, got_T, want_T in zip(VARYING_T, got, want, strict=True):
        assert torch.equal(got_T[3], want_T[3])  # tokens_per_expert: same routing
        for i, (g, w) in enumerate(zip(got_T, want_T, strict=True)):
            if i != 3:
                assert_close(g, w, grad=i >= 4, dtype=torch.float32, msg=f"{case} T={T} #{i}")


def _steps_over_token_counts(layer: MoELayer, fn: object) -> list[list[torch.Tensor]]:
    """Forward + backward of ``fn`` at every T of VARYING_T (same inputs for every ``fn``)."""
    g = torch.Generator().manual_seed(0)
    return [_step(fn, layer, torch.randn(T, MOE.hidden_size, generator=g)) for T in VARYING_T]


@pytest.mark.parametrize("case", [
    pytest.param("c1", marks=pytest.mark.slow), "c3-none",
    pytest.param("c3-recompute", marks=pytest.mark.slow)])
def test_fullgraph_over_varying_token_counts_equals_eager_with_one_recompile(case: str) -> None:
    """T = 16, 24, 32, 40 through one ``fullgraph`` compile: eager's values and gradients, and
    one recompile at most (the second T makes T dynamic; the chunk sizes ⌊(T + c − 1 − i)/c⌋ are
    symbolic, with no guard per value of T). ``c3-recompute`` is slow-only: the same chunk
    split with twice the trace, and its dynamic-T graph is the next test's."""
    layer = _layer(case)
    want = _steps_over_token_counts(layer, layer)
    with dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        got = _steps_over_token_counts(layer, compiled)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    _assert_steps_equal(got, want, case)


def test_marked_dynamic_token_count_compiles_once() -> None:
    """With T marked dynamic up front (``torch._dynamo.mark_dynamic``), one graph serves every
    T of VARYING_T: no recompile."""
    layer = _layer("c3-recompute")
    g = torch.Generator().manual_seed(0)
    with dynamo.config.patch(capture_scalar_outputs=True, error_on_recompile=True):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for T in VARYING_T:
            x = torch.randn(T, MOE.hidden_size, generator=g)
            dynamo.mark_dynamic(x, 0)
            want, _ = layer(x)
            got, _ = compiled(x)
            assert_close(got, want, msg=f"T={T}")
    assert counters["stats"]["unique_graphs"] == 1


def _recording(fn: Any, chunks: list[int]) -> Any:
    """``fn`` that appends each call's chunk count to ``chunks``."""
    def call(x: torch.Tensor) -> Any:
        out, aux = fn(x)
        chunks.append(aux.num_chunks)
        return out, aux
    return call


@pytest.mark.parametrize("marked", [
    pytest.param(False, id="automatic"),
    pytest.param(True, id="marked-dynamic", marks=pytest.mark.slow)])
def test_budget_under_fullgraph_over_varying_token_counts_equals_eager(marked: bool) -> None:
    """A budgeted layer under ``fullgraph`` at T = 16 … 40: eager MACT's c (1, 2, 4, 4) and
    eager's values and gradients. c is chosen by comparing the symbolic T with the policy's
    thresholds T_max(c) (shape guards): one graph per bin in use, plus the first, static T
    under automatic dynamic shapes (none with T marked dynamic up front); T = 40 reuses the
    graph of T = 32 (same bin)."""
    layer = MoELayer(MOE, chunk=WIDE_BUDGET)
    chunks: dict[str, list[int]] = {"eager": [], "compiled": []}
    want = _steps_over_token_counts(layer, _recording(layer, chunks["eager"]))
    graphs = []
    with dynamo.config.patch(capture_scalar_outputs=True):
        compiled = _recording(torch.compile(layer, backend="aot_eager", fullgraph=True),
                              chunks["compiled"])

        def counting(x: torch.Tensor) -> Any:
            if marked:
                dynamo.mark_dynamic(x, 0)
            result = compiled(x)
            graphs.append(counters["stats"]["unique_graphs"])
            return result
        got = _steps_over_token_counts(layer, counting)
    assert chunks["compiled"] == chunks["eager"] == [1, 2, 4, 4]
    _assert_steps_equal(got, want, "budget")
    assert graphs[3] == graphs[2], graphs  # T = 40: the graph of T = 32 (bin c = 4)
    assert graphs[-1] == 3, graphs  # T = 16, 24 and 32: three bins, or a static T and two bins


@pytest.mark.parametrize("allow", [
    pytest.param(False, id="refused"),
    pytest.param(True, id="allowed", marks=pytest.mark.slow)])
def test_budget_under_fullgraph_that_no_bin_meets(allow: bool) -> None:
    """A budget no bin meets at T = 32 (and does at T = 16): the compiled call raises eager's
    one-line InfeasibleBudgetError, naming the T of the call; with ``allow_over_budget`` it
    warns once and runs the largest bin, with eager's values."""
    layer = MoELayer(MOE, chunk=ChunkConfig(memory_budget_bytes=36_000,
                                            allow_over_budget=allow))
    limits = layer.policy.token_limits(4)
    assert 16 <= max(limits) < 32, limits
    g = torch.Generator().manual_seed(0)
    small, large = (torch.randn(T, MOE.hidden_size, generator=g) for T in (16, 32))
    with dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        compiled(small)
        if not allow:
            with pytest.raises(InfeasibleBudgetError) as eager:
                layer(large)
            messages = []
            for x in (large, torch.randn(36, MOE.hidden_size, generator=g)):
                with pytest.raises(InfeasibleBudgetError) as caught:  # T = 36: the same graph
                    compiled(x)
                messages.append(str(caught.value))
            assert messages[0] == str(eager.value)  # dropless: s″ = T·k, eager's numbers
            assert "\n" not in messages[1] and "T=36 tokens and s''=72 " in messages[1]
            return
        chunks: list[int] = []
        with pytest.warns(UserWarning, match="allow_over_budget") as warned:
            got = _step(_recording(compiled, chunks), layer, large)
            _step(_recording(compiled, chunks), layer, large)
        assert len(warned) == 1 and chunks == [8, 8]  # the largest bin
    want = _step(layer, layer, large)
    assert torch.equal(got[3], want[3])
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if i != 3:
            assert_close(a, b, grad=i >= 4, msg=f"tensor {i}")


def test_token_limits_are_folded_as_dynamo_constants() -> None:
    """The threshold function carries the flag ``torch.compiler.assume_constant_result`` sets
    (and nothing else that decorator sets), so Dynamo calls it on constants while tracing."""
    def probe() -> int:
        return 0
    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and vars(probe) == {"_dynamo_marked_constant": True}
    assert traced._token_limits._dynamo_marked_constant is True  # type: ignore[attr-defined]
