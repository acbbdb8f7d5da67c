"""Split LoRA on a 4-bit (NF4) base against dequantise-then-LoRA with explicit W + s·B·A.

The reference dequantises the whole base once (bitsandbytes), merges the adapters densely and runs
the per-token reference; the fused path dequantises per row block the experts a block holds, at
most m (the window) at once.
fp32 compute: output, dx, the routing weights' and every adapter's gradient within 1e-5 relative.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import timeouts
from memfine.config import backward_block_rows
from memfine.config.lora import dequant_window
from memfine.dispatch import build_routing_index
from memfine.experts.lora_experts import run_lora_experts
from memfine.lora.adapters import ExpertLoRA
from memfine.reference import reference_experts

pytest.importorskip("bitsandbytes", reason="the 4-bit base needs bitsandbytes (memfine[qlora])")

from memfine.lora import quant  # noqa: E402
from memfine.lora.quant import NF4Block, NF4Experts, QuantizedBase  # noqa: E402

T, D, N, E, K, R = 40, 32, 64, 8, 2, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def _problem(targets: str = "both"):
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    x = torch.randn(T, D, generator=gen).requires_grad_()
    w = torch.rand(T, K, generator=gen).requires_grad_()
    w_up = torch.randn(E, D, 2 * N, generator=gen) / D ** 0.5
    w_down = torch.randn(E, N, D, generator=gen) / N ** 0.5

    def leaf(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).requires_grad_()
    up, down = targets in ("both", "up"), targets in ("both", "down")
    ad = {"a_up_ERD": leaf(E, R, D) if up else None, "b_up_EGR": leaf(E, 2 * N, R) if up else None,
          "a_down_ERN": leaf(E, R, N) if down else None,
          "b_down_EDR": leaf(E, D, R) if down else None}
    return x, idx, w, w_up, w_down, ad


@pytest.mark.parametrize("targets", ["both", "up", "down"])
@pytest.mark.parametrize("block_bytes", [2**30, 4096, 40 * 1664],
                         ids=["one_block", "row_blocks", "windows"])
def test_adapter_gradients_equal_dequantise_then_lora(targets: str, block_bytes: int) -> None:
    x, idx, w, w_up, w_down, ad = _problem(targets)
    quant = QuantizedBase.quantize(w_up, w_down)
    scale = 2.0
    index = build_routing_index(idx, E)
    out = run_lora_experts(x, w, index, *quant.stand_ins(), ExpertLoRA(**ad, scale=scale),
                           block_rows=backward_block_rows(block_bytes, D, N, 2 * N, 4), quant=quant)
    up, down = quant.up.dequantize(), quant.down.dequantize()  # the reference's dense base
    if ad["a_up_ERD"] is not None:
        up = up + scale * torch.einsum("erd,egr->edg", ad["a_up_ERD"], ad["b_up_EGR"])
    if ad["a_down_ERN"] is not None:
        down = down + scale * torch.einsum("ern,edr->end", ad["a_down_ERN"], ad["b_down_EDR"])
    ref = reference_experts(x, idx, w, up, down)
    assert _rel(out, ref) < 1e-5
    grad_out = torch.randn_like(out)
    leaves = [x, w, *(t for t in ad.values() if t is not None)]
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(ref, leaves, grad_out)
    for name, g, r in zip(["x", "w", *(k for k, t in ad.items() if t is not None)], got, want,
                          strict=True):
        assert _rel(g, r) < 1e-5, name


@pytest.mark.parametrize("block_bytes", [4096, 40 * 1664], ids=["m1", "m4"])
def test_no_more_than_the_window_is_dequantised(monkeypatch: pytest.MonkeyPatch,
                                                block_bytes: int) -> None:
    """At most m experts are dequantised at once, though blocks hold more (windows of m)."""
    x, idx, w, w_up, w_down, ad = _problem()
    quant = QuantizedBase.quantize(w_up, w_down)
    m = dequant_window(backward_block_rows(block_bytes, D, N, 2 * N, 4), E, D, N, 2 * N)
    assert m == (1 if block_bytes == 4096 else 4)
    widths: list[int] = []
    held: list[int] = []
    original, product = NF4Experts.dequantize, NF4Block.grouped_mm

    def spy(self: NF4Experts, e0: int = 0, e1: int | None = None) -> torch.Tensor:
        out = original(self, e0, e1)
        widths.append(out.shape[0])
        return out

    def spy_block(self: NF4Block, *args: object) -> torch.Tensor:
        held.append(self.e1 - self.e0)
        return product(self, *args)  # type: ignore[arg-type]
    monkeypatch.setattr(NF4Experts, "dequantize", spy)
    monkeypatch.setattr(NF4Block, "grouped_mm", spy_block)
    out = run_lora_experts(x, w, build_routing_index(idx, E), *quant.stand_ins(),
                           ExpertLoRA(**ad, scale=2.0),
                           block_rows=backward_block_rows(block_bytes, D, N, 2 * N, 4), quant=quant)
    out.sum().backward()
    assert max(held) > m and max(widths) == m


def test_quantisation_is_deterministic_and_compact() -> None:
    _, _, _, w_up, w_down, _ = _problem()
    a, b = QuantizedBase.quantize(w_up, w_down), QuantizedBase.quantize(w_up, w_down)
    assert torch.equal(a.up.codes, b.up.codes) and torch.equal(a.down.absmax, b.down.absmax)
    numel = w_up.numel() + w_down.numel()
    assert a.nbytes == numel // 2 + 4 * numel // 64  # codes + one fp32 absmax per 64 values


def test_unquantisable_shape_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^LoRAConfig.base_quant='nf4' needs w_down's n·d = "
                                         r"48 \(per expert\) divisible by the block size 64, "
                                         r"got 48 % 64 = 48$"):
        QuantizedBase.quantize(torch.randn(2, 8, 64), torch.randn(2, 6, 8))


def test_no_cpu_matmul_kernels_warning() -> None:
    """bitsandbytes' note about its CPU 4-bit matmul kernels (never run here) is not printed;
    other records of that logger still are."""
    code = ("import torch; from memfine.lora.quant import QuantizedBase; "
            "QuantizedBase.quantize(torch.randn(2, 8, 16), torch.randn(2, 8, 8))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeouts.scaled(120), check=True)
    assert "gemm_4bit_forward" not in proc.stderr, proc.stderr
    other = logging.LogRecord(quant._KERNELS_LOGGER, logging.WARNING, "", 0, "another", (), None)
    assert quant._not_kernels_record(other)
