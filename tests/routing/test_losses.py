"""Load-balancing loss and z-loss: values and grads vs float64 formulas, padding, sentinels."""

from __future__ import annotations

import pytest
import torch

from memfine.routing import load_balancing_loss, z_loss
from tolerances import assert_close

T, E, K = 10, 6, 2


def _lbl_formula(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """E·Σ_i f_i·P_i written out in float64 with Python loops for f."""
    t, k = index.shape
    probs = logits.double().softmax(-1)
    f = [sum(int(e) == i for e in index.flatten()) / (t * k) for i in range(E)]
    return E * sum(f[i] * probs[:, i].mean() for i in range(E))


def _distinct_index(t: int = T) -> torch.Tensor:
    return torch.stack([torch.randperm(E)[:K] for _ in range(t)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["float64", "float32", "bfloat16"])
def test_load_balancing_loss_value_and_grad(dtype: torch.dtype) -> None:
    logits = torch.randn(T, E).to(dtype).requires_grad_(True)
    index = _distinct_index()
    loss = load_balancing_loss(logits, index)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = _lbl_formula(ref_logits, index)
    assert_close(loss, ref, dtype=loss.dtype)
    loss.backward()
    ref.backward()
    assert_close(logits.grad, ref_logits.grad, grad=True, dtype=loss.dtype)


def test_load_balancing_loss_ignores_sentinel_ids() -> None:
    logits = torch.randn(T, E)
    index = _distinct_index()
    with_sentinels = index.clone()
    with_sentinels[::2, 1] = E
    with_sentinels[1::2, 1] = -1
    loss = load_balancing_loss(logits, with_sentinels)
    kept = with_sentinels[:, :1]  # the slot-0 assignments, still normalised by T·k
    expected = E * (torch.bincount(kept.flatten(), minlength=E) / (T * K)
                    * logits.softmax(-1).mean(0)).sum()
    assert_close(loss, expected)
    all_sentinel = torch.full((T, K), -1)
    assert float(load_balancing_loss(logits, all_sentinel)) == 0.0


def test_load_balancing_loss_mask_equals_valid_subset() -> None:
    logits = torch.randn(T, E, requires_grad=True)
    index = _distinct_index()
    mask = torch.tensor([True, False] * (T // 2))
    padded = torch.where(mask[:, None], index, E)
    loss = load_balancing_loss(logits, padded, mask)
    sub = logits.detach()[mask].requires_grad_(True)
    expected = load_balancing_loss(sub, index[mask])
    assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert torch.equal(logits.grad[~mask], torch.zeros(T // 2, E))
    assert_close(logits.grad[mask], sub.grad, grad=True)


def test_losses_without_valid_tokens_are_zero_with_zero_grad() -> None:
    logits = torch.full((4, E), float("nan"), requires_grad=True)
    mask = torch.zeros(4, dtype=torch.bool)
    lbl = load_balancing_loss(logits, torch.full((4, K), E), mask)
    z = z_loss(logits, mask)
    (lbl + z).backward()
    assert float(lbl.detach()) == 0.0 and float(z.detach()) == 0.0
    assert torch.equal(logits.grad, torch.zeros(4, E))
    empty = torch.zeros(0, E, requires_grad=True)
    assert float(load_balancing_loss(empty, torch.zeros(0, K, dtype=torch.long)).detach()) == 0.0
    assert float(z_loss(empty).detach()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16],
                         ids=["float64", "float32", "float16"])
def test_z_loss_value_and_grad(dtype: torch.dtype) -> None:
    logits = (4 * torch.randn(T, E)).to(dtype).requires_grad_(True)
    z = z_loss(logits)
    ref_logits = logits.detach().double().requires_grad_(True)
    lse = [torch.log(torch.exp(row).sum()) for row in ref_logits]
    ref = sum(v ** 2 for v in lse) / T
    assert z.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(z, ref, dtype=z.dtype)
    z.backward()
    ref.backward()
    assert_close(logits.grad, ref_logits.grad, grad=True,
                 dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def test_z_loss_mask() -> None:
    logits = torch.randn(T, E)
    mask = torch.arange(T) % 3 == 0
    assert_close(z_loss(logits, mask), z_loss(logits[mask]))


def test_global_counts_make_the_mean_of_shard_losses_the_whole_batch_loss() -> None:
    """Data/expert parallel: f from the global counts, P local → mean over shards == one process."""
    T, E, k = 12, 6, 2
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    index = logits.detach().topk(k, dim=-1).indices
    whole = load_balancing_loss(logits, index)
    counts = torch.bincount(index.reshape(-1), minlength=E)
    shards = [load_balancing_loss(logits[s], index[s], counts_E=counts)
              for s in (slice(0, T // 2), slice(T // 2, T))]
    assert_close(torch.stack(shards).mean(), whole)
    (g_whole,) = torch.autograd.grad(whole, logits)
    (g_shards,) = torch.autograd.grad(torch.stack(shards).mean(), logits)
    assert_close(g_shards, g_whole, grad=True)


def test_global_counts_shape_is_checked() -> None:
    logits = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"counts_E must be \(E,\) with E=3"):
        load_balancing_loss(logits, torch.zeros(4, 1, dtype=torch.long),
                            counts_E=torch.ones(4, dtype=torch.long))
