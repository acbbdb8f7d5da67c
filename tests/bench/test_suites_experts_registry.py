"""A half-registered method of the experts suite is refused with its name, not a KeyError."""

from __future__ import annotations

import pytest
import torch

from memfine.bench.options import BenchOptions
from memfine.bench.suites import experts


def test_method_listed_without_a_builder_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(experts, "METHODS", (*experts.METHODS, "argsort_fused"))
    with pytest.raises(ValueError, match=r"\['argsort_fused'\] have no builder"):
        experts.build_methods(experts.QUICK, BenchOptions(), torch.device("cpu"), ("fused",))
