"""transformers' common model tests (ModelTesterMixin, TrainingTesterMixin) on six MoE models.

transformers' per-model test files (tests/models/<arch>/test_modeling_<arch>.py) and
tests/causal_lm_tester.py are not in its sdist or wheel; the common mixins are. This module is
the smallest stand-in for those per-model files: one tiny config and test class per
architecture, running every test of the mixins. ``scripts/run_hf_model_tests.sh`` runs it once
with transformers' default experts implementation and once with "memfine" and compares.
"""

from __future__ import annotations

import unittest

import torch
import transformers

from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from ...test_training_mixin import TrainingTesterMixin

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

    Test.__name__ = Test.__qualname__ = f"{tester_classes[2].replace('ForCausalLM', '')}MemfineTest"
    return Test


Qwen3MoeMemfineTest = _test_class("qwen3_moe")
Qwen2MoeMemfineTest = _test_class("qwen2_moe")
OlmoeMemfineTest = _test_class("olmoe")
MixtralMemfineTest = _test_class("mixtral")
DeepseekV3MemfineTest = _test_class("deepseek_v3")
GptOssMemfineTest = _test_class("gpt_oss")
