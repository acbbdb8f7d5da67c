"""MACT's chunk count and row blocks while ``torch.compile`` traces a budgeted layer, unbroken.

Eagerly the policy reads s″ (one host number) and T and predicts each bin's peak
(:meth:`memfine.schedule.ChunkPolicy.decide`). While tracing, T is a symbolic size (after the
first recompile) and s″ is a device value, so :func:`traced_plan` plans from the bound
s″ ≤ T·k instead, which is exact on one process (the policy's prediction is the same for every
s″ ≤ T·k):

1. the thresholds T_max(c), one per bin at the default row block (a traced fused call runs as
   one block, so the eager ladder's smaller blocks are not planned), the most tokens whose
   predicted peak fits the budget
   (:meth:`memfine.schedule.ChunkPolicy.token_limits`; MemFine Eq. 8's s′_max in tokens), are
   computed on host integers from constants only (the policy, named by its int ``key``, D_t
   and the device type), in :func:`_token_limits`, which Dynamo calls once and folds into a
   constant;
2. c is the first bin with ``T <= T_max(c)`` (MemFine Eq. 9): plain comparisons on the
   symbolic T, which become shape guards, so a graph serves every T of one bin, and a T in
   another bin compiles once more;
3. a T above every threshold cannot be met: the graph calls ``memfine::over_budget``, which
   runs the policy's own decision on the concrete T when the graph runs, so it raises the
   one-line :class:`memfine.schedule.InfeasibleBudgetError` (or, with ``allow_over_budget``,
   warns once and the graph runs the largest bin).

Compiled calls record no :class:`memfine.schedule.ChunkDecision` (a record written while
tracing would describe the trace, not the call); only the over-budget call records its own.

Reference: MemFine (arXiv 2511.21431) Eq. 8-9, §4.2; docs/compile.md.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from memfine.experts.run import compute_element_size
from memfine.schedule.policy import ChunkPlan, ChunkPolicy


def _token_limits(policy_key: int, dtype_bytes: int, device_type: str) -> tuple[int, ...]:
    """T_max(c) per bin, at the default row block, of the policy named ``policy_key`` (cached)."""
    return ChunkPolicy.registered(policy_key).token_limits(dtype_bytes, device_type,
                                                           all_blocks=False)


# What torch.compiler.assume_constant_result does (it sets this flag and returns the function),
# without importing Dynamo with memfine: Dynamo runs the function on its constant arguments
# while tracing and uses the result as a constant. tests/nn/test_moe_compile.py checks that
# the decorator still sets exactly this flag.
_token_limits._dynamo_marked_constant = True  # type: ignore[attr-defined]


@torch.library.custom_op("memfine::over_budget", mutates_args=())
def _over_budget(top_k_index: torch.Tensor, policy_key: int, num_tokens: int,
                 dtype_bytes: int) -> None:
    """Run the policy's decision for a T above every threshold: raise, or warn and go on.

    ``top_k_index`` only gives the op a device to dispatch on (and the memory model its
    device type).

    Raises:
        InfeasibleBudgetError: unless ``allow_over_budget`` (then a warning, once per policy).
    """
    policy = ChunkPolicy.registered(policy_key)
    policy.decide(num_tokens * policy.moe.top_k, num_tokens, dtype_bytes,
                  device_type=top_k_index.device.type)


@_over_budget.register_fake
def _over_budget_fake(top_k_index: torch.Tensor, policy_key: int, num_tokens: int,
                      dtype_bytes: int) -> None:
    return None


# An op without outputs is dead code to the graph passes unless it is marked as having a side
# effect (its error is the effect).
has_side_effect(torch.ops.memfine.over_budget.default)


def traced_plan(policy: ChunkPolicy, x_TD: torch.Tensor, top_k_index: torch.Tensor
                ) -> ChunkPlan:
    """The chunk count c and row blocks of a budgeted call while ``torch.compile`` traces it.

    Args:
        policy: the layer's budgeted :class:`ChunkPolicy` (local experts: no transport rows).
        x_TD: (T, d) layer input (T may be symbolic; D_t is its element size).
        top_k_index: (T, k) int64 expert ids (only the over-budget check reads it, for its
            device).

    Returns:
        The first bin c whose threshold at the default row block T is within (a traced fused
        call runs as one block, so the ladder's smaller blocks are not planned here); when T
        exceeds every such threshold, the largest bin (the compiled call then raises
        :class:`memfine.schedule.InfeasibleBudgetError` unless ``allow_over_budget``).

    Reference: MemFine Eq. 8-9 (s′_max and the binned chunk count), with s″ = T·k.
    """
    num_tokens, dtype_bytes = x_TD.shape[0], compute_element_size(x_TD)
    default = policy.ladder(x_TD.device.type, dtype_bytes)[0]
    bins = policy.config.bins
    limits = _token_limits(policy.key, dtype_bytes, x_TD.device.type)
    for c, limit in zip(bins, limits, strict=True):
        if num_tokens <= limit:
            return ChunkPlan(c, default)
    torch.ops.memfine.over_budget(top_k_index, policy.key, num_tokens, dtype_bytes)
    return ChunkPlan(bins[-1], default)
