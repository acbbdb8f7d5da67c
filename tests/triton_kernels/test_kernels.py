"""Triton expert kernels (memfine[triton]) on CPU under TRITON_INTERPRET=1, at tiny sizes.

Every kernel is compared with the torch path it replaces (loop backend, combine_rows,
apply_activation) and the fused Function on the triton backend with the per-token reference.
GPU-only checks are marked ``gpu``. Reference: MoEBlaze §4; docs/style.md §6, §9.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from devices import triton_cpu
from memfine.activations import apply_activation
from memfine.dispatch import RoutingIndex, build_routing_index
from memfine.experts import run_experts
from memfine.ops.combine import combine_rows, gather_rows
from memfine.ops.grouped import grouped_mm as torch_grouped_mm
from memfine.reference import reference_experts
from tolerances import assert_close

pytest.importorskip("triton", reason="needs triton (pip install 'memfine[triton]')")
DEVICE = "cpu"  # the default suite runs on the CPU; CUDA tests are marked gpu (devices.py)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _routing(T: int, E: int, k: int, sentinels: int = 2) -> torch.Tensor:
    """(T, k) int64 ids: expert E-1 left empty, the last ``sentinels`` slots set to E."""
    idx = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])
    idx.view(-1)[idx.numel() - sentinels:] = E
    return idx


def _index(T: int = 9, E: int = 4, k: int = 2) -> RoutingIndex:
    index = build_routing_index(_routing(T, E, k), E)
    return dataclasses.replace(index, **{
        f.name: getattr(index, f.name).to(DEVICE) for f in dataclasses.fields(index)
        if isinstance(getattr(index, f.name), torch.Tensor)})  # not num_experts, host_offsets


def test_tile_schedule() -> None:
    from memfine.triton_kernels import tile_schedule

    offsets = torch.tensor([0, 5, 5, 21, 22], dtype=torch.int32)
    tile_expert, tile_start = tile_schedule(offsets, 8, 22)
    # ceil(22 / 8) + min(E, S) = 3 + 4 tiles: the experts' 4, then 3 idle ones at expert 3's end
    assert tile_expert.tolist() == [0, 2, 2, 3, 3, 3, 3]
    assert tile_start.tolist() == [0, 5, 13, 21, 22, 22, 22]
    empty_expert, empty_start = tile_schedule(torch.zeros(4, dtype=torch.int32), 8, 0)
    assert empty_expert.numel() == 0 and empty_start.numel() == 0


class _SyncCounter(TorchDispatchMode):
    """Records every ATen op that reads a device value back to the host."""

    SYNCS = ("_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.__name__.split(".")[0] in self.SYNCS:
            self.syncs.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seed", range(4))
def test_tile_schedule_reads_nothing_back_and_covers_each_row_once(seed: int) -> None:
    from memfine.triton_kernels import tile_schedule

    gen = torch.Generator().manual_seed(seed)
    E, BM = 9, 4
    counts = torch.randint(0, 11, (E,), generator=gen)
    counts[seed % E] = 0  # an empty expert
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
    S = int(offsets[-1])
    with _SyncCounter() as mode:
        tile_expert, tile_start = tile_schedule(offsets, BM, S)
    assert mode.syncs == []
    assert tile_expert.numel() == -(-S // BM) + min(E, S)
    covered = torch.zeros(S, dtype=torch.long)
    for e, start in zip(tile_expert.tolist(), tile_start.tolist(), strict=True):
        end = int(offsets[e + 1])
        assert int(offsets[e]) <= start <= end
        covered[start:min(start + BM, end)] += 1  # the rows a kernel program writes
    assert covered.tolist() == [1] * S


@triton_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous_w", "transposed_w"])
def test_grouped_mm_matches_loop(dtype: torch.dtype, transposed: bool) -> None:
    from memfine.triton_kernels import grouped_mm

    index = _index()
    E, num_in, num_out = 4, 12, 20
    x_SI = torch.randn(index.num_rows, num_in, dtype=dtype, device=DEVICE)
    w_EIO = (torch.randn(E, num_out, num_in, dtype=dtype, device=DEVICE).transpose(1, 2)
             if transposed else torch.randn(E, num_in, num_out, dtype=dtype, device=DEVICE))
    got = grouped_mm(x_SI, w_EIO, index.expert_token_offsets)
    want = torch_grouped_mm(x_SI.double(), w_EIO.double(), index.expert_token_offsets, "loop")
    assert_close(got, want, dtype=dtype)


@triton_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "relu", "silu"])
def test_gather_up_matches_torch(activation: str, dtype: torch.dtype) -> None:
    from memfine.triton_kernels import gather_up

    index = _index()
    E, D, N = 4, 12, 10
    G = 2 * N if activation in ("swiglu", "geglu") else N
    x_TD = torch.randn(index.num_tokens, D, dtype=dtype, device=DEVICE)
    w_EDG = (torch.randn(E, D, G, device=DEVICE) / D ** 0.5).to(dtype)
    h_SG, a_SN = gather_up(x_TD, w_EDG, index.expert_token_indices, index.expert_token_offsets,
                           activation)
    h_want = torch_grouped_mm(gather_rows(x_TD.double(), index.expert_token_indices),
                              w_EDG.double(), index.expert_token_offsets, "loop")
    assert_close(h_SG, h_want, dtype=dtype)
    assert_close(a_SN, apply_activation(h_want, activation), dtype=dtype)


@triton_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_down_combine_matches_torch(dtype: torch.dtype) -> None:
    from memfine.triton_kernels import down_combine

    index = _index()
    E, D, N = 4, 12, 10
    a_SN = torch.randn(index.num_rows, N, dtype=dtype, device=DEVICE)
    w_END = (torch.randn(E, N, D, device=DEVICE) / N ** 0.5).to(dtype)
    valid_TK = index.token_index_map >= 0
    weights_TK = torch.where(valid_TK, torch.rand(valid_TK.shape, device=DEVICE), float("nan"))
    w_S = weights_TK.reshape(-1)[index.expert_slot_indices.long()].to(dtype)
    out_TD = down_combine(a_SN, w_END, index.expert_token_offsets, w_S, index.token_index_map)
    y_SD = torch_grouped_mm(a_SN.double(), w_END.double(), index.expert_token_offsets, "loop")
    want = combine_rows(y_SD, weights_TK.double(), index.token_index_map)
    assert torch.isfinite(out_TD).all()  # NaN weights of sentinel slots are never read
    assert_close(out_TD, want, dtype=dtype)


@triton_cpu
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_fused_triton_backend_matches_reference(activation: str) -> None:
    T, E, k, D, N = 9, 4, 2, 12, 10
    G = 2 * N if activation == "swiglu" else N
    idx = _routing(T, E, k)
    leaves = [torch.randn(T, D), torch.rand(T, k), torch.randn(E, D, G) / D ** 0.5,
              torch.randn(E, N, D) / N ** 0.5]
    x, w, w_up, w_down = (t.to(DEVICE).requires_grad_() for t in leaves)
    out = run_experts(x, w, build_routing_index(idx.to(DEVICE), E), w_up, w_down,
                      activation=activation, backend="triton")
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference_experts(ref_leaves[0], idx, *ref_leaves[1:], activation=activation)
    assert_close(out.cpu(), ref.detach(), dtype=torch.float32)
    grad_out = torch.randn(T, D)
    out.backward(grad_out.to(DEVICE))
    ref.backward(grad_out.double())
    for got, want in zip((x, w, w_up, w_down), ref_leaves, strict=True):
        assert got.grad is not None and want.grad is not None
        assert_close(got.grad.cpu(), want.grad, grad=True, dtype=torch.float32)


def test_fake_impls_give_shapes() -> None:
    from memfine.triton_kernels import down_combine, gather_up, grouped_mm

    real = _index()
    S, T, k = real.num_rows, real.num_tokens, real.top_k
    with FakeTensorMode() as mode:
        idx_S, off_E1, map_TK = (mode.from_tensor(t) for t in (
            real.expert_token_indices, real.expert_token_offsets, real.token_index_map))
        x_TD = torch.empty(T, 8, dtype=torch.bfloat16)
        h_SG, a_SN = gather_up(x_TD, torch.empty(4, 8, 12, dtype=torch.bfloat16), idx_S, off_E1,
                               "swiglu")
        y_SO = grouped_mm(a_SN, torch.empty(4, 6, 5, dtype=torch.bfloat16), off_E1)
        out_TD = down_combine(a_SN, torch.empty(4, 6, 8, dtype=torch.bfloat16), off_E1,
                              torch.empty(S, dtype=torch.bfloat16), map_TK)
    assert (h_SG.shape, a_SN.shape, y_SO.shape, out_TD.shape) == ((S, 12), (S, 6), (S, 5), (T, 8))
    assert k == 2
