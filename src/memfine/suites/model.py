"""``model`` suite: one training step of the small MoE language model, four ways.

A step is forward (cross-entropy + aux losses, as ``memfine train`` adds them), backward and an
AdamW step; the harness's ``fwd`` mode is the forward with the loss, ``bwd`` the backward with
the optimizer step, ``full`` the whole step. Every method starts from the same weights and sees
the same batch (random byte ids). Optimizer states exist before the measured step (warm-up).

Methods: ``plain`` (gather/scatter copies), ``fused`` (memfine default), ``fused_mact`` (chunked
with per-chunk recompute under a per-layer budget; default: half the received rows per chunk,
c = 2), ``full_recompute`` (each transformer block recomputed in backward, routing kept); with
``--compile`` also ``fused_compiled`` and ``fused_mact_compiled`` (the model's forward and losses
under ``torch.compile``; peak bytes from ``torch.profiler``).

Shapes: the ``small`` training preset (what ``make train`` runs: d 128, n 128, E 8, k 2,
4 layers, 32 × 128 tokens per step); ``--quick`` uses the ``tiny`` preset with 4 sequences.
The memory model covers one MoE layer, not a whole model: predictions read "not modelled".
Legend: B batch, Q sequence.
Reference: MemFine §4 (full recompute vs chunked MoE recompute); docs/design.md §4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from memfine.baselines.layers import compiled, half_rows_budget, prepare_compiled
from memfine.bench.harness import Extra, Method, run_methods
from memfine.bench.options import COMPILED_SUFFIX, BenchOptions, Point, announce
from memfine.config import ChunkConfig, ModelConfig, MoEConfig
from memfine.nn import MoETransformerLM
from memfine.train.presets import preset
from memfine.units import format_bytes

NAME = "model"
METHODS = ("plain", "fused", "fused_mact", "full_recompute")
COMPILABLE = ("fused", "fused_mact")
REFERENCE = "fused"
LR = 1e-4  # small: the weights move little over the timed steps


def model_shape(opts: BenchOptions) -> tuple[ModelConfig, int, int]:
    """(model config, batch size B, sequence length Q), size overrides applied (k > E raises)."""
    train = preset("tiny" if opts.quick else "small")
    batch = 4 if opts.quick else train.batch_size
    moe = train.model.moe
    sizes: dict[str, Any] = {k: v for k, v in opts.explicit_sizes().items() if k != "tokens"}
    if "hidden_size" in sizes and "intermediate_size" not in sizes:
        sizes["intermediate_size"] = moe.intermediate_size
    k, E = sizes.get("top_k", moe.top_k), sizes.get("num_experts", moe.num_experts)
    if k > E:
        raise ValueError(f"--top-k must be at most --num-experts: the model has k {k} and E {E}")
    if sizes:
        moe = dataclasses.replace(moe, **sizes)
        if moe.top_k == 1:
            moe = dataclasses.replace(moe, renormalize=False)
    if opts.tokens is not None:
        batch = max(1, opts.tokens // train.seq_len)
    return dataclasses.replace(train.model, moe=moe), batch, train.seq_len


def _variant(model: ModelConfig, name: str, budget: int) -> ModelConfig:
    moe: MoEConfig = model.moe
    if name == "plain":
        return dataclasses.replace(model, moe=dataclasses.replace(moe, experts_impl="plain"),
                                   chunk=ChunkConfig(recompute="none"))
    chunk = {"fused": ChunkConfig(recompute="none"),
             "fused_mact": ChunkConfig(memory_budget_bytes=budget, recompute="experts"),
             "full_recompute": ChunkConfig(recompute="full")}[name]
    return dataclasses.replace(model, chunk=chunk)


def step_method(name: str, model: MoETransformerLM, ids_BQ: torch.Tensor,
                targets_BQ: torch.Tensor, backend: str | None = None) -> Method:
    """A training step of ``model`` on one batch as a :class:`Method`.

    With a ``backend``, the forward (model and losses) runs under ``torch.compile`` and the
    method's peak bytes are measured with ``torch.profiler``.
    """
    moe = model.config.moe
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    state = {"num_chunks": 1}
    call = model if backend is None else compiled(model, backend)

    def forward() -> Any:
        out = call(ids_BQ, targets_BQ)
        state["num_chunks"] = max(a.num_chunks for a in out.aux)
        return out.loss + moe.aux_loss_coef * out.load_balancing_loss + (
            moe.z_loss_coef * out.z_loss)

    def backward(loss: Any) -> None:
        loss.backward()
        optimizer.step()

    def extras() -> dict[str, Extra]:
        return {"num_chunks": (state["num_chunks"], "chunks")}

    return Method(name=name, forward=forward, backward=backward,
                  zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
                  tokens=ids_BQ.numel(), exclude=lambda: list(model.buffers()), extras=extras,
                  peak="tracker" if backend is None else "profiler")


shapes = model_shape  # resolved by the runner before its first line


def budget_calls(opts: BenchOptions, names: tuple[str, ...]
                 ) -> list[tuple[str, MoEConfig, ChunkConfig, int]]:
    """(point, MoE config, chunk config, T) of each ``--memory-budget`` layer call to run."""
    if "fused_mact" not in {n.removesuffix(COMPILED_SUFFIX) for n in names}:
        return []
    config, batch, seq = model_shape(opts)
    mact = _variant(config, "fused_mact", opts.budget_bytes or 0)
    return [("MoE LM", mact.moe, mact.chunk, batch * seq)]


def run(opts: BenchOptions, device: torch.device, names: tuple[str, ...]
        ) -> Iterator[Point]:
    """Run the suite: one point (the model shape); at least one warm-up step (optimizer state)."""
    opts = dataclasses.replace(prepare_compiled(opts, names), warmup=max(1, opts.warmup))
    config, batch, seq = model_shape(opts)
    moe = config.moe
    dtype = opts.torch_dtype
    dt = torch.empty((), dtype=dtype).element_size()
    budget = opts.budget_bytes or half_rows_budget(config.moe, batch * seq, dt, device.type)
    gen = torch.Generator().manual_seed(opts.seed + 1)
    data_BQ = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen).to(device)
    torch.manual_seed(opts.seed)
    state = MoETransformerLM(config).state_dict()
    methods = []
    for name in names:
        eager = name.removesuffix(COMPILED_SUFFIX)
        model = MoETransformerLM(_variant(config, eager, budget))
        model.load_state_dict(state)
        model.to(device=device, dtype=dtype)
        methods.append(step_method(name, model, data_BQ[:, :-1], data_BQ[:, 1:],
                                   opts.compile_backend if eager != name else None))
    announce(NAME, f"MoE LM, {batch * seq} tokens per step", opts, len(names))
    results = run_methods(methods, repeats=opts.repeats, warmup=opts.warmup, device=device)
    label = (f"MoE LM: {config.num_layers} layers, d={moe.hidden_size} n={moe.intermediate_size} "
             f"E={moe.num_experts} k={moe.top_k}, B={batch} x Q={seq} = {batch * seq} tokens, "
             f"{opts.dtype}; MACT budget {format_bytes(budget)} per layer")
    cfg = {"model": config.to_dict(), "batch_size": batch, "seq_len": seq, "dtype": opts.dtype,
           "budget_bytes": budget, "optimizer": f"AdamW lr={LR}"}
    yield Point(suite=NAME, x_name="model", x_value="small" if not opts.quick else "tiny",
                label=label, config=cfg, results=results, reference=REFERENCE)
