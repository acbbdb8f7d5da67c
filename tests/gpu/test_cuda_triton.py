"""Native Triton kernels on CUDA: the fused path against torch._grouped_mm, and offsets past 2³¹.

The large case is real: T = 2²⁰ + 64 tokens at d 2048 (T·d > 2³¹ elements, 4 GiB in bf16 per
(T, d) tensor), k 1, through ``down_combine`` (its grouped GEMM and combine kernels).
"""

from __future__ import annotations

import pytest
import torch

from devices import triton_gpu
from memfine.dispatch import build_routing_index
from memfine.experts import run_experts
from tolerances import assert_close

pytestmark = triton_gpu
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_triton_matches_grouped_mm(dtype: torch.dtype) -> None:
    T, E, k, D, N = 515, 8, 2, 256, 136  # ragged tails; expert 7 empty
    idx = torch.rand(T, E - 1).argsort(-1)[:, :k].cuda()
    index = build_routing_index(idx, E)
    base = [torch.randn(T, D), torch.rand(T, k), torch.randn(E, D, 2 * N) / D**0.5,
            torch.randn(E, N, D) / N**0.5]
    outs = []
    for backend in ("triton", "grouped_mm"):
        leaves = [t.to("cuda", dtype).requires_grad_() for t in base]
        out = run_experts(leaves[0], leaves[1], index, *leaves[2:], backend=backend)
        out.backward(torch.ones_like(out))
        outs.append([out.detach(), *(t.grad for t in leaves)])
    for got, want in zip(*outs, strict=True):
        assert_close(got.double(), want.double(), grad=True, dtype=dtype)


def test_down_combine_past_2_31_elements() -> None:
    from memfine.triton_kernels import down_combine

    T, D, N = 2**20 + 64, 2048, 16
    assert T * D > 2**31
    token = torch.arange(T, device="cuda")
    index = build_routing_index((token % 2).unsqueeze(1), 2)  # k 1, two experts
    a_SN = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    w_END = (torch.randn(2, N, D, device="cuda") / N**0.5).bfloat16()
    w_S = torch.rand(T, device="cuda", dtype=torch.bfloat16)
    out_TD = down_combine(a_SN, w_END, index.expert_token_offsets, w_S, index.token_index_map)
    rows = index.expert_token_indices.long()  # the token of each grouped row
    for lo in range(T - 4096, T, 1024):  # the last rows: their offsets pass 2**31
        sel = slice(lo, lo + 1024)
        e = (rows[sel] % 2)
        want = torch.einsum("sn,snd->sd", a_SN[sel].float(), w_END[e].float()) * w_S[sel, None]
        assert_close(out_TD[rows[sel]].float(), want, dtype=torch.bfloat16)
