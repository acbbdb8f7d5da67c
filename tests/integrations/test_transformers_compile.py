"""transformers generation under torch.compile with memfine experts (docs/compile.md).

``generate`` with a static cache compiles the decoding forward (transformers' own
``test_generate_compilation_all_outputs`` path); memfine's experts must give the same greedy
tokens as transformers' ``eager`` experts. Tiny random models with n = 30, where transformers'
``grouped_mm`` fails on the CPU in fp32, so ``eager`` is the reference. The default suite compiles
with ``aot_eager`` (Dynamo + AOT autograd tracing, where the fp32 ``_grouped_mm`` fake-tensor
error used to stop it); ``-m slow`` also runs inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install memfine[hf])")

from hf_models import tiny_causal_lm  # noqa: E402

from memfine.integrations import transformers as mf_hf  # noqa: E402


def _generate(model: torch.nn.Module, ids: torch.Tensor, backend: str | None) -> torch.Tensor:
    kwargs: dict[str, object] = dict(max_new_tokens=5, do_sample=False, use_cache=True,
                                     cache_implementation="static")
    if backend is None:
        kwargs["disable_compile"] = True
    else:
        config = transformers.CompileConfig(backend=backend, mode="default", fullgraph=True)
        config._compile_all_devices = True  # transformers compiles on the CPU only when asked
        kwargs["compile_config"] = config
    return model.generate(ids, **kwargs)


# By default gpt_oss with aot_eager: both models trace the same call (``run_module``), and
# gpt_oss's experts add biases and the clamped interleaved SwiGLU; qwen3_moe's plain layout
# runs compiled with -m slow (eager in the default suite, test_transformers.py).
@pytest.mark.parametrize(("model_type", "backend"), [
    pytest.param("gpt_oss", "aot_eager", id="gpt_oss-aot_eager"),
    pytest.param("qwen3_moe", "aot_eager", id="qwen3_moe-aot_eager", marks=pytest.mark.slow),
    *(pytest.param(m, "inductor", id=f"{m}-inductor", marks=pytest.mark.slow)
      for m in ("qwen3_moe", "gpt_oss"))])
def test_compiled_generate_gives_the_eager_tokens(model_type: str, backend: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    run_module = mf_hf.run_module

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return run_module(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mf_hf, "run_module", counted)
    mf_hf.register()
    model = tiny_causal_lm(model_type).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    model.set_experts_implementation("eager")
    want = _generate(model, ids, None)
    model.set_experts_implementation("memfine")
    dynamo.reset()
    with dynamo.config.patch(capture_scalar_outputs=True, error_on_recompile=False):
        got = _generate(model, ids, backend)
    assert calls  # memfine's experts ran (traced and run in prefill and decoding)
    assert got.shape == (2, 10)
    assert torch.equal(got, want)
