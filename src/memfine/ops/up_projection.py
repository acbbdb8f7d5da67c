"""The up-projection of the experts, held as one (E, d, G) tensor or as its two halves.

memfine's own layout keeps the gate and up halves in one tensor ``w_up_EDG`` (E, d, 2n) with
``[gate | up]`` columns. Some frameworks keep them as two parameters (torchtitan's
``GroupedExperts``: ``w1`` gate and ``w3`` up, each (E, n, d)). Concatenating them every step
would copy E·d·2n weight elements and, inside an autograd Function, save that copy for backward;
the helpers here compute with the halves where they are instead. ``H = [x·w_gate | x·w_up]``
equals ``x·cat(w_gate, w_up)`` exactly: each column of H is the same dot product either way.

Legend: S routed rows, E experts, D = d, N = n, G = 2n (two halves) or the width of one tensor.
Reference: docs/design.md §1 (SwiGLU weights); MoEBlaze §5 (what the fused path saves).
"""

from __future__ import annotations

import torch

from memfine.ops.grouped import grouped_mm, grouped_weight_grad

UpWeights = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""(E, d, G) up-projection, or its (gate, up) halves, each (E, d, n)."""


def up_parts(w_up: UpWeights) -> tuple[torch.Tensor, ...]:
    """The up-projection as a tuple of one (E, d, G) tensor or two (E, d, n) halves.

    Raises:
        ValueError: if a pair's halves differ in shape or dtype, or a tuple is not a pair.
    """
    if isinstance(w_up, torch.Tensor):
        return (w_up,)
    parts = tuple(w_up)
    if len(parts) != 2:
        raise ValueError(f"w_up must be a tensor or a (gate, up) pair, got {len(parts)} parts")
    gate, up = parts
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"w_up halves must share shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    return parts


def up_shape(w_up: UpWeights) -> tuple[int, int, int]:
    """(E, d, G) of the up-projection (G summed over the halves)."""
    parts = up_parts(w_up)
    E, D, _ = parts[0].shape
    return E, D, sum(p.shape[2] for p in parts)


def up_project(x_SD: torch.Tensor, parts: tuple[torch.Tensor, ...], offsets_E1: torch.Tensor,
               backend: str) -> torch.Tensor:
    """H (S, G) = x · [parts], one grouped GEMM per part (no weight concatenation).

    Memory: with two halves, the two (S, n) products are transients of the (S, G) result.
    """
    if len(parts) == 1:
        return grouped_mm(x_SD, parts[0], offsets_E1, backend)
    return torch.cat([grouped_mm(x_SD, p, offsets_E1, backend) for p in parts], dim=1)


def _column_blocks(grad_h_SG: torch.Tensor, parts: tuple[torch.Tensor, ...]
                   ) -> list[torch.Tensor]:
    """The columns of dH that belong to each part (contiguous copies when there are two)."""
    if len(parts) == 1:
        return [grad_h_SG]
    widths = [p.shape[2] for p in parts]
    return [block.contiguous() for block in torch.split(grad_h_SG, widths, dim=1)]


def up_input_grad(grad_h_SG: torch.Tensor, parts: tuple[torch.Tensor, ...],
                  offsets_E1: torch.Tensor, backend: str) -> torch.Tensor:
    """Gradient of the gathered rows, (S, d) = dH · [parts]ᵀ, summed over the parts.

    Memory: with two halves, one (S, n) copy of each dH block and one (S, d) partial sum
    (transients).
    """
    grad_x_SD = None
    for block_SN, part in zip(_column_blocks(grad_h_SG, parts), parts, strict=True):
        term = grouped_mm(block_SN, part.transpose(1, 2), offsets_E1, backend)
        grad_x_SD = term if grad_x_SD is None else grad_x_SD.add_(term)
    assert grad_x_SD is not None, "the up-projection has at least one part"
    return grad_x_SD


def up_weight_grads(x_SD: torch.Tensor, grad_h_SG: torch.Tensor,
                    parts: tuple[torch.Tensor, ...], offsets_E1: torch.Tensor,
                    num_experts: int, backend: str) -> list[torch.Tensor]:
    """Weight gradient of each part, in its memory layout; experts with no rows get exact zeros."""
    return [grouped_weight_grad(x_SD, block, offsets_E1, num_experts, backend, like=part)
            for block, part in zip(_column_blocks(grad_h_SG, parts), parts, strict=True)]
