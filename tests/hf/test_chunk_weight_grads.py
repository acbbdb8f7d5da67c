"""The transformers chunk loop shares one weight-gradient buffer per weight across its chunks.

Measured with ``torch.profiler`` (the CPU ground truth): at a token count where the expert weights'
gradients dominate, the chunked call must not peak above the unchunked one (autograd summing the
chunks' gradients would hold two weight-gradient-sized buffers at once), and the gradients equal
the unchunked ones.
"""

from __future__ import annotations

import pytest
import torch

from tolerances import assert_close

pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                    "'memfine[hf]')")

from hf_models import tiny_experts  # noqa: E402

from memfine.integrations import transformers as mf_hf  # noqa: E402
from memfine.measure import measure_memory  # noqa: E402


def _peak_and_grads(experts: torch.nn.Module, c: int, x_TD: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                    ) -> tuple[int, dict[str, torch.Tensor]]:
    config = mf_hf.make_config(num_chunks=c) if c > 1 else mf_hf.make_config()
    x = x_TD.clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    with measure_memory(exclude=list(experts.parameters()), peak="profiler") as m:
        out = mf_hf.memfine_experts_forward(experts, x, top_k_index, top_k_weights,
                                            config=config)
        m.end_forward()
        out.backward(torch.ones_like(out))
        del out
    peak = m.report().peak_bytes
    assert peak is not None
    return peak, {n: p.grad.clone() for n, p in experts.named_parameters()}


@pytest.mark.parametrize("c", [2, 4])
def test_chunked_peak_not_above_unchunked(c: int) -> None:
    """qwen3_moe experts (E=5, d=16, n=10), T=4: weight gradients dominate the peak."""
    experts = tiny_experts("qwen3_moe")[0]
    E = int(experts.num_experts)
    T, k = 4, 2
    x_TD = torch.randn(T, experts.gate_up_proj.shape[-1])
    top_k_index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    top_k_weights = torch.rand(T, k)
    peak_1, grads_1 = _peak_and_grads(experts, 1, x_TD, top_k_index, top_k_weights)
    peak_c, grads_c = _peak_and_grads(experts, c, x_TD, top_k_index, top_k_weights)
    weight_grad_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    assert peak_1 >= weight_grad_bytes  # the weights' gradients are part of the peak
    assert peak_c <= peak_1, (peak_c, peak_1)
    for name, want in grads_1.items():
        assert_close(grads_c[name], want, grad=True, msg=name)
