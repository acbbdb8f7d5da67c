"""Allocation timeline of one training step of the small MoE language model (bytes, integers).

:func:`simulate_step` replays :class:`memfine.nn.MoETransformerLM`'s forward and backward with
one (recompute mode, chunk count) per layer: the embedding, every block's attention part (RMSNorm,
qkv, rotary embeddings, SDPA, projection, residual), the MoE layer (its exact timeline,
:func:`memfine.memory.layer.moe_layer_timeline`, placed at its point of the step), the final norm,
the tied logits and the cross-entropy; backward in the autograd engine's order, the blocks in
reverse, each block's saved tensors freed by its backward, parameter gradients kept to the end.

Protocol (as the tests measure): the input ids exist before; parameters have no ``.grad``;
``loss = CE + a·LBL + z·z-loss`` (the aux losses' gradients are scalars); the caller keeps the
:class:`memfine.nn.model.LMOutput` (logits) until backward ends.

Legend: B batch, Q sequence, T = B·Q tokens, D = d, V vocab, H heads, D_t activation bytes.
Reference: our derivation from the code (docs/design.md §5: peak = saved + largest transient;
MemFine Eq. 2 for the layer terms it itemises).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, overload

from memfine.config import ModelConfig, RecomputeMode
from memfine.memory import layer as layer_memory
from memfine.timeline.base import Timeline

STEP_RECOMPUTE: tuple[RecomputeMode, ...] = ("none", "experts", "full")
"""A layer's recompute options in a step plan (``full``: the whole block)."""


@dataclass(frozen=True, slots=True)
class LayerChoice:
    """One MoE block's execution in a step: recompute mode and chunk count.

    Attributes:
        recompute: ``none``, ``experts`` (chunked expert recompute) or ``full`` (the block).
        num_chunks: c, token chunks of the expert part.
    """

    recompute: RecomputeMode
    num_chunks: int


@dataclass(frozen=True, slots=True)
class _Moe:
    """The MoE layer's own timeline, reduced to what the step needs (bytes)."""

    forward_peak: int
    kept: int  # live after its forward, the output excluded
    backward_peak: int  # above the live bytes at the start of its backward (output included)
    end: int  # live after its backward: dx of its input, its parameter gradients and counts;
    # not the output (freed in the step by the residual sum)


@functools.lru_cache(maxsize=256)
def _moe(config: ModelConfig, T: int, dt: int, choice: LayerChoice, device_type: str = "cpu"
         ) -> _Moe:
    """The layer timeline's numbers, moved from the layer's protocol to the step's.

    The layer timeline's caller keeps the layer output to the end, the step frees it at the
    residual sum: ``end`` leaves it out (counted there, it over-predicted the mid model's step
    by one T·d per finished layer, 1.2%). The router node frees the layer's (T, k) top-k
    index with its saved tensors; the counts of MoEAux stay to the end, in ``end``.
    """
    rec = "none" if choice.recompute == "none" else "experts"
    tl = layer_memory.moe_layer_timeline(config.moe, T, dt, num_chunks=choice.num_chunks,
                                         recompute=rec, device_type=device_type)
    out = T * config.moe.hidden_size * dt
    fwd = tl.marks["forward"]
    bwd = max(tl.phase_peaks["losses_backward"], tl.phase_peaks["end"])
    return _Moe(forward_peak=tl.phase_peaks["forward"], kept=fwd - out,
                backward_peak=bwd - fwd, end=tl.marks["end"] - out)


class _Step:
    """The step's running timeline and the names of what each block keeps."""

    def __init__(self, config: ModelConfig, batch: int, seq: int, dt: int) -> None:
        self.c, self.B, self.Q, self.dt = config, batch, seq, dt
        self.T, self.D = batch * seq, config.moe.hidden_size
        self.tl = Timeline(record=False)

    def td(self, name: str, factor: float = 1.0) -> str:
        """Allocate a (T, D·factor) activation."""
        return self.tl.alloc(name, int(self.T * self.D * factor) * self.dt)

    def norm(self, prefix: str, output: bool = True) -> list[str]:
        """RMSNorm forward (a composite on CPU): [rstd (T,), x·rstd (T, D), output (T, D)].

        x² and its mean are transient; x·rstd and the output are both saved (the weight's
        multiply keeps its input), the output last in the list.
        """
        tl = self.tl
        square = self.td(f"{prefix}.square")
        mean = tl.alloc(f"{prefix}.mean", self.T * self.dt)
        tl.free(square)
        rstd = tl.alloc(f"{prefix}.rstd", self.T * self.dt)
        tl.free(mean)
        saved = [rstd, self.td(f"{prefix}.normalized")]
        return saved + [self.td(f"{prefix}.out")] if output else saved

    @overload
    def attention_forward(self, keep: bool, rerun: Literal[False] = False
                          ) -> tuple[list[str], str, str]: ...

    @overload
    def attention_forward(self, keep: bool, rerun: bool
                          ) -> tuple[list[str], str, str | None]: ...

    def attention_forward(self, keep: bool, rerun: bool = False
                          ) -> tuple[list[str], str, str | None]:
        """attn_norm → qkv → RoPE(q, k) → SDPA → proj → residual → moe_norm.

        Returns (saved names, h, the MoE input); with ``keep=False`` (a checkpointed region)
        nothing but the two outputs survives. ``rerun``: the checkpoint's recomputation, which
        stops once the last saved tensor is packed (autograd saves a multiply's inputs before
        it runs), so the region's last output is never allocated (returned as None).
        """
        tl, H = self.tl, self.c.num_heads
        saved = self.norm("attn_norm")
        saved.append(self.td("qkv", 3))
        saved += self.rope_tables()
        for part in ("q", "k"):
            halves = [self.td(f"rope.{part}.{i}", 0.5) for i in range(4)]
            first, second = self.td(f"rope.{part}.a", 0.5), self.td(f"rope.{part}.b", 0.5)
            tl.free(*halves)
            saved.append(self.td(f"rope.{part}"))
            tl.free(first, second)
        saved += [self.td("sdpa.out"), tl.alloc("sdpa.lse", self.B * H * self.Q * 4)]
        saved.append(self.td("sdpa.out_BQD"))  # transpose(1, 2).reshape copies (proj's input)
        proj = self.td("proj")
        h = self.td("h")
        tl.free(proj)
        norm2 = self.norm("moe_norm", output=not rerun)
        if not keep:
            tl.free(*saved, *norm2[:2])
            return [], h, norm2[2]
        return saved + norm2[:2], h, None if rerun else norm2[2]

    def rope_tables(self) -> list[str]:
        """nn.attention._rope_tables: the (Q, A/2) fp32 cos and sin of one attention forward.

        The inverse frequencies (A/2) and the positions (Q, int64 then fp32) and their outer
        product are transient; cos and sin are saved by RoPE's multiplies.
        """
        tl, Q = self.tl, self.Q
        half = self.D // self.c.num_heads // 2
        steps = tl.alloc("rope.arange", half * 8)
        as_float = tl.alloc("rope.arange_f", half * 4)
        tl.free(steps)
        scaled = tl.alloc("rope.scaled", half * 4)
        tl.free(as_float)
        power = tl.alloc("rope.power", half * 4)
        tl.free(scaled)
        inv = tl.alloc("rope.inv", half * 4)
        tl.free(power)
        positions = tl.alloc("rope.positions", Q * 8)
        positions_f = tl.alloc("rope.positions_f", Q * 4)
        tl.free(positions)
        freqs = tl.alloc("rope.freqs", Q * half * 4)
        tl.free(positions_f, inv)
        tables = [tl.alloc("rope.cos", Q * half * 4), tl.alloc("rope.sin", Q * half * 4)]
        tl.free(freqs)
        return tables

    def norm_backward(self, prefix: str, saved: list[str], grad_out: str) -> None:
        """RMSNorm backward, node by node of the CPU composite (pow, mean, rsqrt, x·rstd, ·weight).

        The weight's multiply makes grad·(x·rstd) (summed to the weight's (D,) gradient) and
        grad·weight at once, then frees its grad_out and saved x·rstd; x·rstd's multiply makes
        d·x (summed to (T,)) and d·rstd; rsqrt's and mean's backward make (T,) temporaries and
        one (T, D); pow's backward holds three (T, D) at once. x's two gradient parts are added
        in place into the buffer of x's gradient (it already holds the residual's), so nothing
        new survives but the weight's gradient; the caller frees x.
        """
        tl, T, dt = self.tl, self.T, self.dt
        weight_part = self.td(f"{prefix}.bwd.dweight")
        d_norm = self.td(f"{prefix}.bwd.dnormalized")
        tl.free(saved[1])
        tl.alloc(f"grad.{prefix}.weight", self.D * dt)
        tl.free(weight_part, grad_out)
        rstd_part, x_part = self.td(f"{prefix}.bwd.drstd_full"), self.td(f"{prefix}.bwd.dx")
        d_rstd = tl.alloc(f"{prefix}.bwd.drstd", T * dt)
        tl.free(rstd_part, d_norm, x_part)  # x_part: summed into x's gradient
        cube = tl.alloc(f"{prefix}.bwd.rstd_cube", T * dt)
        scaled = tl.alloc(f"{prefix}.bwd.rstd_scaled", T * dt)
        d_mean = tl.alloc(f"{prefix}.bwd.dmean", T * dt)
        tl.free(cube, scaled, d_rstd, saved[0])
        d_square = self.td(f"{prefix}.bwd.dsquare")
        tl.free(d_mean)
        pow_parts = [self.td(f"{prefix}.bwd.pow.{i}") for i in range(3)]
        tl.free(d_square, *pow_parts)  # the last one: summed into x's gradient

    def attention_backward(self, saved: list[str], h: str, moe_in: str, grad_h: str,
                           grad_moe_in: str) -> str:
        """Backward of the attention part, its saved tensors freed node by node.

        Returns the block input's gradient (summed in place into ``grad_h``).
        """
        tl = self.tl
        rstd1, nz1, n1, qkv, cos, sin, rq, rk, out, lse, out_bqd, rstd2, nz2 = saved
        tl.free(moe_in)
        self.norm_backward("bwd.moe_norm", [rstd2, nz2], grad_moe_in)
        tl.free(h)
        grad_y = self.td("bwd.proj.dx")
        tl.alloc("grad.proj.weight", self.D * self.D * self.dt)
        tl.free(out_bqd)
        grads = [self.td(f"bwd.sdpa.d{p}") for p in "qkv"]
        tl.free(grad_y, rq, rk, out, lse)
        rope = []
        for i, part in enumerate("qk"):
            products = [self.td(f"bwd.rope.{part}.{j}", 0.5) for j in range(4)]
            halves = [self.td(f"bwd.rope.{part}.x{j}", 0.5) for j in (1, 2)]
            tl.free(*products)
            rope.append(self.td(f"bwd.rope.{part}"))
            tl.free(*halves, grads[i])
        tl.free(cos, sin)
        grad_qkv = self.td("bwd.qkv", 3)
        tl.free(*rope, grads[2], qkv)
        grad_n = self.td("bwd.qkv.dx")
        tl.alloc("grad.qkv.weight", 3 * self.D * self.D * self.dt)
        tl.free(grad_qkv, n1)
        self.norm_backward("bwd.attn_norm", [rstd1, nz1], grad_n)
        return grad_h


def parameter_bytes(config: ModelConfig, dt: int) -> dict[str, int]:
    """Parameter (= gradient) bytes of the embedding (tied head) and of one block."""
    moe, D = config.moe, config.moe.hidden_size
    experts = moe.num_experts * D * (moe.up_width + moe.intermediate_size)
    block = 4 * D * D + 2 * D + moe.num_experts * D + experts
    if moe.num_shared_experts:
        sh = moe.shared_experts_config()
        block += sh.num_experts * D * (sh.up_width + sh.intermediate_size)
    return {"embedding": config.vocab_size * D * dt + D * dt, "block": block * dt}


def simulate_step(config: ModelConfig, batch: int, seq: int, dtype_bytes: int,
                  plan: tuple[LayerChoice, ...], device_type: str = "cpu") -> Timeline:
    """Replay one training step's forward + backward with one :class:`LayerChoice` per layer.

    Args:
        config: the model.
        batch: B sequences.
        seq: Q tokens per sequence.
        dtype_bytes: D_t of activations and parameters (4 on CPU).
        plan: one choice per layer (``len(plan) == config.num_layers``).
        device_type: the activations' device (the MoE layers' default row blocks and index
            builder, as the layers resolve them there).

    Returns:
        The :class:`memfine.timeline.base.Timeline` (``peak``; marks ``forward``, ``end``).

    Raises:
        ValueError: if the plan's length is not the number of layers, or a choice is invalid.
    """
    if len(plan) != config.num_layers:
        raise ValueError(f"plan must hold one LayerChoice per layer ({config.num_layers}), got "
                         f"{len(plan)}")
    for choice in plan:
        if choice.recompute not in STEP_RECOMPUTE or choice.num_chunks < 1:
            raise ValueError(f"LayerChoice.recompute must be one of {STEP_RECOMPUTE} and "
                             f"num_chunks >= 1, got {choice}")
    s = _Step(config, batch, seq, dtype_bytes)
    tl, T, dt, V = s.tl, s.T, dtype_bytes, config.vocab_size
    moes = [_moe(config, T, dt, choice, device_type) for choice in plan]
    stream = s.td("embed.out")
    blocks = []
    for choice, moe in zip(plan, moes, strict=True):
        full = choice.recompute == "full"
        saved, h, moe_in = s.attention_forward(keep=not full)
        tl.free(tl.alloc("moe.forward_peak", moe.forward_peak))
        kept = tl.alloc("moe.kept", moe.kept)
        out = s.td("moe.out")
        new = s.td("block.out")
        tl.free(out)
        if full:  # h only feeds the residual sum: not saved
            tl.free(h)
        blocks.append((choice, moe, saved, h, moe_in, kept, stream))
        stream = new
    final = s.norm("final_norm")
    logits = tl.alloc("logits", T * V * dt)
    log_probs = tl.alloc("ce.log_softmax", T * V * 4)
    tl.mark("forward")
    # The mean over layers of LBL and of the z-loss: their backward's (L,) fp32 gradients come
    # first; each layer's router node holds a view of both until it runs, the first block's last
    aux_grads = tl.alloc("bwd.aux_loss_grads", 2 * config.num_layers * 4)
    grad_nll = tl.alloc("bwd.ce.nll", T * V * 4)
    grad_logits = tl.alloc("bwd.ce.log_softmax", T * V * 4)
    tl.free(grad_nll, log_probs)
    grad_n = s.td("bwd.head.dx")
    tl.alloc("grad.embedding", V * s.D * dt)
    tl.free(grad_logits)
    grad = s.td("bwd.final_norm.dx")
    tl.free(grad_n, *final, stream)
    tl.alloc("grad.final_norm", s.D * dt)
    for i, (choice, moe, saved, h, moe_in, kept, block_in) in reversed(list(enumerate(blocks))):
        tl.free(tl.alloc("moe.backward_peak", moe.backward_peak))
        tl.free(kept)
        end = tl.alloc("moe.end", moe.end - T * s.D * dt)
        if i == 0:  # the first block's router node has run
            tl.free(aux_grads)
        grad_moe_in = s.td("moe.dx")
        if choice.recompute == "full":  # the attention region runs again, then backward
            saved, h, _ = s.attention_forward(keep=True, rerun=True)
        grad = s.attention_backward(saved, h, moe_in, grad, grad_moe_in)
        tl.free(block_in)
        del end
    tl.free(tl.alloc("bwd.embedding", V * s.D * dt))  # summed into the tied weight's grad
    tl.free(grad, logits)
    tl.mark("end")
    return tl
