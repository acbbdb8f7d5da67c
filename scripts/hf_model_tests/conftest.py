"""pytest plugin for transformers' own model tests with memfine as the default experts backend.

Copied next to transformers' ``tests/`` by ``scripts/run_hf_model_tests.sh``. With
``MEMFINE_HF_EXPERTS=<name>`` it makes ``<name>`` the experts implementation of every model whose
config does not request one (where transformers would pick ``grouped_mm``); tests that request an
implementation by name keep it. ``memfine`` is registered first
(``memfine.integrations.transformers.register()``); ``eager`` is the baseline run. Unset (or
``default``): nothing is changed.
This patch lives in the test harness only; memfine itself never patches transformers.
"""

from __future__ import annotations

import os

IMPL = os.environ.get("MEMFINE_HF_EXPERTS", "default")


def pytest_configure(config: object) -> None:
    """Register memfine and make it the default experts implementation (memfine runs only)."""
    if IMPL in ("", "default"):
        return
    from transformers import modeling_utils

    from memfine.integrations.transformers import register

    if IMPL == "memfine":
        register()
    original = modeling_utils.PreTrainedModel.get_correct_experts_implementation

    def get_correct_experts_implementation(self, requested_experts):  # type: ignore[no-untyped-def]
        return original(self, IMPL if requested_experts is None else requested_experts)

    modeling_utils.PreTrainedModel.get_correct_experts_implementation = (
        get_correct_experts_implementation)
