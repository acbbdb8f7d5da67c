"""transformers' common model tests (ModelTesterMixin, TrainingTesterMixin) on every MoE model.

transformers' per-model test files (tests/models/<arch>/test_modeling_<arch>.py) and
tests/causal_lm_tester.py are not in its sdist or wheel; the common mixins are. This module is
the smallest stand-in for those per-model files: one tiny config and test class per
architecture, running every test of the mixins, plus memfine's own checks against "eager" in the
same process (generation with a cache on a left-padded batch, and the load-balancing loss of a
padded batch with ``output_router_logits=True``). ``scripts/run_hf_model_tests.sh`` runs it once
with "eager" and once with "memfine" as the default experts implementation and compares.

Architectures: six hand-written configs (below) plus every other transformers architecture with
an experts module (``@use_experts_implementation``) and a causal LM class whose default config,
shrunk generically (d = 32, 2 layers, E = 6, k = 2, n = 30, vocabulary 61), builds a model of
under 3M parameters that runs a forward pass; ``SKIPPED`` holds the others with the reason
(``scripts/run_hf_model_tests.sh`` prints it).
"""

from __future__ import annotations

import os
import unittest

import torch
import transformers

from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from ...test_training_mixin import TrainingTesterMixin
from .hf_models import experts_architectures, generic_causal_lm

# model_type -> (config class, base model class, causal LM class, config kwargs); expert
# intermediate size n = 30 (not a multiple of 4: transformers' grouped_mm cannot run it on CPU).
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeModel", "Qwen3MoeForCausalLM", dict(
        moe_intermediate_size=30, num_experts=6, num_experts_per_tok=2, head_dim=8,
        decoder_sparse_step=1)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeModel", "Qwen2MoeForCausalLM", dict(
        moe_intermediate_size=30, num_experts=5, num_experts_per_tok=2,
        shared_expert_intermediate_size=24, decoder_sparse_step=1)),
    "olmoe": ("OlmoeConfig", "OlmoeModel", "OlmoeForCausalLM", dict(
        intermediate_size=30, num_experts=6, num_experts_per_tok=3)),
    "mixtral": ("MixtralConfig", "MixtralModel", "MixtralForCausalLM", dict(
        intermediate_size=30, num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3Model", "DeepseekV3ForCausalLM", dict(
        moe_intermediate_size=30, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    "gpt_oss": ("GptOssConfig", "GptOssModel", "GptOssForCausalLM", dict(
        intermediate_size=30, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
}


# MEMFINE_HF_ARCHS=a,b (set by scripts/run_hf_model_tests.sh --arch): build and test only these
# architectures (probing all of them at import takes a minute or more on a loaded CPU).
_ONLY = {a for a in os.environ.get("MEMFINE_HF_ARCHS", "").split(",") if a}
if _ONLY:
    ARCHS = {arch: entry for arch, entry in ARCHS.items() if arch in _ONLY}
SKIPPED: dict[str, str] = {}
for _arch in experts_architectures():
    if _arch in ARCHS or (_ONLY and _arch not in _ONLY):
        continue
    _entry, _why = generic_causal_lm(_arch)
    if _entry is None:
        SKIPPED[_arch] = _why
    else:
        ARCHS[_arch] = _entry


class TinyCausalLMTester:
    """The parts of transformers' CausalLMModelTester that the common mixins use."""

    batch_size, seq_length, vocab_size = 3, 7, 61
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 32, 2, 4, 2
    intermediate_size = 40
    is_training = True

    def __init__(self, parent: unittest.TestCase, model_type: str) -> None:
        self.parent = parent
        config_name, base, causal, self.kwargs = ARCHS[model_type]
        self.config_class = getattr(transformers, config_name)
        self.base_model_class = getattr(transformers, base)
        self.causal_lm_class = getattr(transformers, causal)
        self.sequence_classification_class = None

    def get_config(self) -> transformers.PreTrainedConfig:
        """The tiny config (fp32, no cache-dependent defaults changed)."""
        kwargs = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      num_hidden_layers=self.num_hidden_layers,
                      num_attention_heads=self.num_attention_heads,
                      num_key_value_heads=self.num_key_value_heads,
                      intermediate_size=self.intermediate_size, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kwargs.update(self.kwargs)
        if "num_key_value_heads" not in self.kwargs and "kv_lora_rank" in self.kwargs:
            kwargs["num_key_value_heads"] = self.num_attention_heads
        return self.config_class(**kwargs)

    def prepare_config_and_inputs_for_common(self) -> tuple[object, dict[str, torch.Tensor]]:
        """(config, {"input_ids", "attention_mask"})."""
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


def _test_class(model_type: str) -> type:
    tester_classes = ARCHS[model_type]

    class Test(ModelTesterMixin, TrainingTesterMixin, unittest.TestCase):
        all_model_classes = (getattr(transformers, tester_classes[1]),
                             getattr(transformers, tester_classes[2]))
        test_torch_exportable = False  # the export mixin is not in the sdist (stubbed)

        def setUp(self) -> None:
            self._model_tester = TinyCausalLMTester(self, model_type)

        @property
        def model_tester(self) -> TinyCausalLMTester:
            return self._model_tester

        test_memfine_generate_with_cache_matches_eager = _check_generate
        test_memfine_padded_router_aux_loss_matches_eager = _check_aux_loss

    Test.__name__ = Test.__qualname__ = f"{tester_classes[2].replace('ForCausalLM', '')}MemfineTest"
    return Test


def _padded_batch(tester: TinyCausalLMTester) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (2, 6): row 0 left-padded by 3 (pad id 0), row 1 full."""
    torch.manual_seed(0)
    input_ids = torch.randint(3, tester.vocab_size, (2, 6))
    attention_mask = torch.ones_like(input_ids)
    input_ids[0, :3], attention_mask[0, :3] = 0, 0
    return input_ids, attention_mask


def _tiny_lm(test: unittest.TestCase, **overrides: object) -> torch.nn.Module:
    from memfine.integrations.transformers import register

    register()
    config = test.model_tester.get_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = test.model_tester.causal_lm_class(config).float().eval()
    with torch.no_grad():  # expert weights large enough to matter next to the residual stream
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(std=0.3)
    return model


def _check_generate(self: unittest.TestCase) -> None:
    """Greedy generation with a cache on a left-padded batch: memfine's tokens == eager's."""
    model = _tiny_lm(self, use_cache=True)
    input_ids, attention_mask = _padded_batch(self.model_tester)
    outputs = {}
    for impl in ("eager", "memfine"):
        model.set_experts_implementation(impl)
        outputs[impl] = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, min_new_tokens=4,
            do_sample=False, use_cache=True, pad_token_id=0, return_dict_in_generate=True,
            output_scores=True)
    self.assertTrue(torch.equal(outputs["eager"].sequences, outputs["memfine"].sequences))
    for eager, memfine in zip(outputs["eager"].scores, outputs["memfine"].scores, strict=True):
        torch.testing.assert_close(memfine, eager, atol=1e-5, rtol=1e-4)


def _check_aux_loss(self: unittest.TestCase) -> None:
    """Padded batch with output_router_logits=True: loss and load-balancing loss == eager's."""
    model = _tiny_lm(self, output_router_logits=True)
    input_ids, attention_mask = _padded_batch(self.model_tester)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    results = {}
    for impl in ("eager", "memfine"):
        model.set_experts_implementation(impl)
        try:
            with torch.no_grad():
                results[impl] = model(input_ids=input_ids, attention_mask=attention_mask,
                                      labels=labels)
        except Exception as err:  # noqa: BLE001 - eager itself cannot: nothing to compare
            if impl == "eager":
                self.skipTest(f"eager raises {type(err).__name__}: {err}")
            raise
    if getattr(results["eager"], "aux_loss", None) is None:
        self.skipTest(f"{type(model).__name__} returns no aux_loss")
    torch.testing.assert_close(results["memfine"].aux_loss, results["eager"].aux_loss,
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results["memfine"].loss, results["eager"].loss, atol=1e-5,
                               rtol=1e-4)


for _model_type in ARCHS:
    _cls = _test_class(_model_type)
    globals()[_cls.__name__] = _cls
del _cls

