"""experts_implementation="memfine" inside ``torch.autocast``: bf16 compute, bf16 saved tensors.

HF fine-tuning runs the model under bf16 autocast with fp32 parameters (``Trainer(bf16=True)``).
The experts must follow autocast as ``nn.Linear`` does: x and H are saved in bf16 (half the fp32
bytes), the output matches the fp32 eager experts within the bf16 tolerance, and the fp32
parameters get fp32 gradients within the bf16 gradient tolerance. Checked on the fused path
(Qwen3-MoE's SwiGLU; GPT-OSS's clamped SwiGLU with biases), on the plain path, and chunked
(each chunk checkpointed: only x, in bf16, and the routing tensors are saved; the fp32 routing
weights are the router's own tensor and are left out of the count).
"""

from __future__ import annotations

import pytest
import torch

from tolerances import assert_close

pytest.importorskip("transformers", reason="transformers is not installed "
                    "(pip install 'memfine[hf]')")

from hf_models import tiny_experts  # noqa: E402

from memfine.integrations import transformers as mf_hf  # noqa: E402
from memfine.measure.saved import SavedTensorsTracker  # noqa: E402

BF16 = torch.bfloat16
T, K = 12, 2
CASES = {
    "qwen3_moe-fused": ("qwen3_moe", {}),
    "gpt_oss-fused-biases": ("gpt_oss", {}),
    "qwen3_moe-plain": ("qwen3_moe", {"impl": "plain"}),
    "gpt_oss-plain-biases": ("gpt_oss", {"impl": "plain"}),
    "gpt_oss-2-chunks": ("gpt_oss", {"num_chunks": 2}),
}


def _inputs(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    E = module.num_experts
    D = module.down_proj.shape[1] if not getattr(module, "is_transposed", False) \
        else module.down_proj.shape[2]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, D, generator=generator)
    top_k_index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    top_k_weights = torch.rand(T, K, generator=generator).softmax(-1)
    return hidden, top_k_index, top_k_weights


def _forward_backward(module: torch.nn.Module, fn, inputs, *, autocast: bool):
    hidden, top_k_index, top_k_weights = inputs
    x = hidden.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast), \
            SavedTensorsTracker(exclude=[*module.parameters(), top_k_weights]) as saved:
        out = fn(module, x, top_k_index, top_k_weights)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * cotangent).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out, x.grad, grads, saved


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, *, grad: bool,
                       name: str) -> None:
    """bf16 tolerance relative to the tensor's largest entry: bf16 rounds every operand, so an
    entry's error scales with the largest terms of the sums that make it, not with itself."""
    scale = float(expected.detach().abs().max().clamp_min(1.0))
    assert_close(actual / scale, expected / scale, grad=grad, dtype=BF16, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_memfine_follows_autocast(case: str) -> None:
    model_type, options = CASES[case]
    module = tiny_experts(model_type)[0]
    inputs = _inputs(module)
    config = mf_hf.make_config(**options)

    def memfine(m, x, idx, w):
        return mf_hf.memfine_experts_forward(m, x, idx, w, config=config)

    def eager(m, x, idx, w):
        return m(x, idx, w)

    ref_out, ref_dx, ref_grads, _ = _forward_backward(module, eager, inputs, autocast=False)
    out, dx, grads, saved = _forward_backward(module, memfine, inputs, autocast=True)
    assert out.dtype == torch.float32  # cast back to the hidden states' dtype
    _assert_bf16_close(out, ref_out, grad=False, name="out")
    _assert_bf16_close(dx, ref_dx, grad=True, name="hidden_states.grad")
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        _assert_bf16_close(grad, ref_grads[name], grad=True, name=name)
    floating = [item for item in saved.items if item.dtype.is_floating_point]
    assert floating and all(item.dtype == BF16 for item in floating), saved.table()
    D = inputs[0].shape[1]
    # Storages (a view of one may be what is saved): x (T, d), gathered on the plain path, and
    # H (S, G) with S = T·k routed rows, each of them 2 bytes per element.
    storage_bytes = {item.nbytes for item in floating}
    rows = T * K if options.get("impl") == "plain" else T
    assert rows * D * 2 in storage_bytes, f"x is saved in bf16\n{saved.table()}"
    if "chunks" not in case:  # chunked: H is recomputed in backward, never saved
        G = 2 * module.down_proj.numel() // (module.num_experts * D)
        assert T * K * G * 2 in storage_bytes, f"H is saved in bf16\n{saved.table()}"
