"""A transformers experts class with a new gate: recognised from gates.py's tables, or warned.

The class here clamps like DeepSeek-V4 but names its limit ``example_bound``, which memfine does
not read: the gate runs on the plain path with one warning per class naming the class and
gates.py. Adding the name to ``LIMIT_ATTRIBUTES`` (the extending recipe) fuses it, equal to the
module's own experts, and the cached plan follows the attribute.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tolerances import assert_close

pytest.importorskip("transformers", reason="transformers is not installed "
                    "(pip install 'memfine[hf]')")

from hf_models import tiny_experts  # noqa: E402

from memfine.config import GatedActivation  # noqa: E402
from memfine.hf import gates, layout  # noqa: E402
from memfine.integrations import transformers as mf_hf  # noqa: E402


def _clamped_gate(self: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    n, limit = h.shape[-1] // 2, self.example_bound
    return F.silu(h[:, :n].clamp(max=limit)) * h[:, n:].clamp(min=-limit, max=limit)


def _clamped_experts(name: str, cls: type | None = None) -> torch.nn.Module:
    (experts,) = tiny_experts("qwen3_moe")
    experts.__class__ = cls or type(name, (type(experts),), {"_apply_gate": _clamped_gate})
    experts.example_bound = 0.5
    return experts


def _recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the recipe adds to gates.py: the attribute's name in LIMIT_ATTRIBUTES."""
    monkeypatch.setattr(gates, "LIMIT_ATTRIBUTES", (*gates.LIMIT_ATTRIBUTES, "example_bound"))
    monkeypatch.setattr(layout, "GATE_ATTRIBUTES", (*layout.GATE_ATTRIBUTES, "example_bound"))


def test_an_unrecognised_gate_warns_once_per_class() -> None:
    experts = _clamped_experts("ClampLimitExperts")
    with pytest.warns(UserWarning, match=r"ClampLimitExperts\._apply_gate runs on the plain "
                      r"path.*hf/gates\.py"):
        plan = mf_hf.plan_experts(experts)
    assert plan.path == "plain" and "no GatedActivation reproduces" in plan.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = _clamped_experts("", cls=type(experts))  # another module of the class
        assert mf_hf.plan_experts(other).path == "plain"


def test_the_recipe_fuses_the_gate_and_matches_the_module(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _recipe(monkeypatch)
    experts = _clamped_experts("ClampLimitRecipeExperts")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = mf_hf.plan_experts(experts)
    assert (plan.path, plan.activation) == ("fused", GatedActivation(limit=0.5))
    x = torch.randn(9, 16, requires_grad=True)
    idx = torch.argsort(torch.rand(9, 5), dim=1)[:, :2].contiguous()
    w = torch.rand(9, 2)
    experts.config._experts_implementation = "batched_mm"  # calls _apply_gate, as memfine does
    assert_close(mf_hf.memfine_experts_forward(experts, x, idx, w), experts(x, idx, w))
    experts.example_bound = 2.0  # the plan follows the attribute it was read from
    assert mf_hf.plan_experts(experts).activation == GatedActivation(limit=2.0)
