"""Split LoRA inside the fused experts: the adapters' forward and streamed backward terms.

Per expert e, on the expert-grouped rows of the fused path (:mod:`memfine.experts.function`):

    H = x·W_up[e] + s·(drop(x)·A_up[e]ᵀ)·B_up[e]ᵀ          (+ b_up[e])
    Y = A·W_down[e] + s·(drop(A)·A_down[e]ᵀ)·B_down[e]ᵀ    (+ b_down[e]),   A = act(H)

with s = α / r. W + s·B·A is never formed: each adapter costs two thin grouped GEMMs through the
rank-r intermediate U = drop(input)·Aᵀ (S, r), which is the only extra tensor saved for backward.

Backward, per row block (dO the block's output-gradient rows, w the routing weights, m the
dropout mask scaled by 1/(1-p), all per expert e of a row):
    down: P = dO·B_down (B, r); dA += s·(P·A_down) ⊙ m  (added before the routing-weight dots,
          which then equal ⟨dO, Y⟩ including the adapter); dB_down += s·(dO)ᵀ·(w·U_down);
          dA_down += s·(w·P)ᵀ·(m ⊙ A)
    up:   Q = dH·B_up (B, r); dB_up += s·dHᵀ·U_up; dA_up += s·Qᵀ·(m ⊙ x); dx += s·(Q·A_up) ⊙ m
Experts with no rows get exactly zero adapter gradients (:class:`WeightGradBuffers`).
Eagerly, where the per-expert ``addmm_`` runs (not bf16's grouped form), dB (E, d_out, r) is
accumulated transposed, as dBᵀ[e] += (s·U)ᵀ·dO (a contiguous (E, r, d_out) buffer), and handed
over as one contiguous copy: a product with r output columns is the slow orientation of the
CPU GEMM (2-4× slower measured at r = 8, d_out 256-512), rank-r output rows the fast one.
For the same reason the eager backward computes P = dO·B_down and Q = dH·B_up from a copy of
B whose per-expert (d_out, r) matrices are column-major (E·d_out·r elements, made per row block
and freed after the product; the product measured 2.1-2.4× faster per block).

Dropout masks are regenerated, never saved: each row block's mask comes from a generator seeded by
(seed, adapter, first row), and the forward builds its masks in the same blocks. The seed is a
plain int chosen once per layer call outside any recomputed region, so a checkpointed chunk's
recompute draws the same masks.

Legend: T tokens, S routed rows, B rows of a block, E experts, D = d, N = n, G = 2n (gated) or n,
R = r (the adapters' rank).
Reference: Hu et al. 2021 (LoRA); MoEBlaze §4.2 (row blocks), §5 (the routing-weight gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfine.ops.combine import gather_rows
from memfine.ops.grouped import grouped_mm
from memfine.ops.weight_grads import (
    WeightGradBuffers,
    accumulate_grouped_weight_grad_,
    uses_grouped_weight_grads,
)

_UP, _DOWN = 0, 1  # adapter ids (dropout streams; also the order of the saved intermediates)
MASK_BLOCK_ROWS = 128  # rows per seeded dropout-mask block


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """Plain values of the adapters of one fused call (no tensors).

    Attributes:
        has_up: the up-projection is adapted (tensors ``a_up_ERD``, ``b_up_EGR`` passed).
        has_down: the down-projection is adapted (``a_down_ERN``, ``b_down_EDR`` passed).
        scale: s = α / r.
        dropout: p in [0, 1) on the adapter inputs.
        seed: the dropout masks' seed (chosen once per layer call, outside recompute).
    """

    has_up: bool
    has_down: bool
    scale: float
    dropout: float = 0.0
    seed: int = 0

    @property
    def num_weights(self) -> int:
        """How many adapter tensors follow the spec among the Function's inputs."""
        return 2 * (int(self.has_up) + int(self.has_down))


@dataclass(frozen=True, slots=True)
class ExpertLoRA:
    """The adapter tensors of one experts block (runtime object, e.g. views of parameters).

    Attributes:
        a_up_ERD: (E, r, d) A of the up-projection, or None.
        b_up_EGR: (E, G, r) B of the up-projection (None with ``a_up_ERD``).
        a_down_ERN: (E, r, n) A of the down-projection, or None.
        b_down_EDR: (E, d, r) B of the down-projection (None with ``a_down_ERN``).
        scale: s = α / r.
        dropout: p in [0, 1) on the adapter inputs.
    """

    a_up_ERD: torch.Tensor | None
    b_up_EGR: torch.Tensor | None
    a_down_ERN: torch.Tensor | None
    b_down_EDR: torch.Tensor | None
    scale: float
    dropout: float = 0.0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The present adapter tensors in Function-input order: (A_up, B_up, A_down, B_down)."""
        return tuple(t for t in (self.a_up_ERD, self.b_up_EGR, self.a_down_ERN, self.b_down_EDR)
                     if t is not None)

    def spec(self, seed: int) -> LoRASpec:
        """The :class:`LoRASpec` of a call with this dropout ``seed``."""
        return LoRASpec(has_up=self.a_up_ERD is not None, has_down=self.a_down_ERN is not None,
                        scale=self.scale, dropout=self.dropout, seed=seed)


def dropout_mask(spec: LoRASpec, adapter: int, r0: int, r1: int, width: int,
                 like: torch.Tensor) -> torch.Tensor | None:
    """(r1 - r0, width) mask of rows [r0, r1) scaled by 1/(1-p), or None without dropout.

    Rows are generated in blocks of :data:`MASK_BLOCK_ROWS` (each from its own seeded
    generator), so any row range gives the same values in forward and in any backward block.
    """
    if spec.dropout == 0.0 or r1 <= r0:
        return None
    keep = 1.0 - spec.dropout
    pieces = []
    first = r0 - r0 % MASK_BLOCK_ROWS
    for b0 in range(first, r1, MASK_BLOCK_ROWS):
        b1 = b0 + MASK_BLOCK_ROWS
        gen = torch.Generator(device=like.device)
        gen.manual_seed((spec.seed * 1_000_003 + adapter * 7_919 + b0) % (2**63 - 1))
        rand = torch.rand(b1 - b0, width, generator=gen, device=like.device)
        pieces.append(rand[max(r0, b0) - b0:min(r1, b1) - b0])
    # NOTE(memory): transient (rows, width) mask; never saved (regenerated in backward)
    rand = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return (rand < keep).to(like.dtype).div_(keep)


def _masked(rows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return rows if mask is None else rows * mask


class LoRAForward:
    """The adapters' forward terms of one fused call, streamed over its row blocks.

    Keeps the rank-r intermediates U (S, r): with one block, each adapter's product is U
    itself; with several, U is allocated at the first block and each block's rows are copied in
    (as H in :func:`memfine.experts.rows.forward_rows`).
    """

    def __init__(self, spec: LoRASpec, weights: tuple[torch.Tensor, ...], backend: str) -> None:
        """``weights``: the adapter tensors in :meth:`ExpertLoRA.tensors` order."""
        self.spec, self.backend = spec, backend
        it = iter(weights)
        self.up = (next(it), next(it)) if spec.has_up else None
        self.down = (next(it), next(it)) if spec.has_down else None
        self._u: dict[int, torch.Tensor] = {}  # adapter id → U (S, r)

    def _term_(self, out_BO: torch.Tensor, in_BI: torch.Tensor, pair: tuple[torch.Tensor, ...],
               adapter: int, offsets_E1: torch.Tensor, r0: int, num_rows: int) -> None:
        a_ERI, b_EOR = pair
        r1 = r0 + in_BI.shape[0]
        mask = dropout_mask(self.spec, adapter, r0, r1, in_BI.shape[1], in_BI)
        if r1 - r0 < num_rows and adapter not in self._u:
            # NOTE(memory): U (S·r elements) is the adapter's only saved activation
            self._u[adapter] = in_BI.new_empty(num_rows, a_ERI.shape[1])
        u_BR = grouped_mm(_masked(in_BI, mask), a_ERI.transpose(1, 2), offsets_E1, self.backend)
        if adapter in self._u:  # several blocks: the block's rows of U (B·r transient)
            self._u[adapter][r0:r1] = u_BR
        else:
            self._u[adapter] = u_BR
        out_BO.add_(grouped_mm(u_BR, b_EOR.transpose(1, 2), offsets_E1, self.backend),
                    alpha=self.spec.scale)

    def up_(self, h_BG: torch.Tensor, x_BD: torch.Tensor, offsets_E1: torch.Tensor, r0: int,
            num_rows: int) -> None:
        """H rows [r0, r0 + B) += s·(drop(x)·A_upᵀ)·B_upᵀ in place (no-op without an up adapter).

        ``num_rows``: S, the call's routed rows (the block is all of them, or one of several).
        """
        if self.up is not None:
            self._term_(h_BG, x_BD, self.up, _UP, offsets_E1, r0, num_rows)

    def down_(self, y_BD: torch.Tensor, a_BN: torch.Tensor, offsets_E1: torch.Tensor, r0: int,
              num_rows: int) -> None:
        """Y rows += s·(drop(A)·A_downᵀ)·B_downᵀ in place (no-op without a down adapter)."""
        if self.down is not None:
            self._term_(y_BD, a_BN, self.down, _DOWN, offsets_E1, r0, num_rows)

    def to_save(self, weights: tuple[torch.Tensor, ...], like: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        """The tensors the Function saves: U_up, U_down (present ones), then the adapters.

        ``like``: x (T, d), whose dtype and device an empty U takes when there are no rows.
        """
        present = [i for i, pair in ((_UP, self.up), (_DOWN, self.down)) if pair is not None]
        return (*(self._u[i] if i in self._u else like.new_empty(0, self._rank(i))
                  for i in present), *weights)

    def _rank(self, adapter: int) -> int:
        pair = self.up if adapter == _UP else self.down
        assert pair is not None, "a present adapter"
        return pair[0].shape[1]


class LoRABackward:
    """The adapters' gradient terms of one streamed backward, block by block."""

    def __init__(self, spec: LoRASpec, saved: tuple[torch.Tensor, ...],
                 needs_grad: tuple[bool, ...], x_TD: torch.Tensor, token_idx_S: torch.Tensor,
                 bounds: list[int] | None, backend: str) -> None:
        """Unpack what :meth:`LoRAForward.to_save` saved; ``needs_grad`` per adapter tensor."""
        self.spec, self.bounds, self.backend = spec, bounds, backend
        self.x_TD, self.token_idx_S = x_TD, token_idx_S
        n_u = int(spec.has_up) + int(spec.has_down)
        us, weights = list(saved[:n_u]), list(saved[n_u:])
        self.u_up = us.pop(0) if spec.has_up else None
        self.u_down = us.pop(0) if spec.has_down else None
        self.weights = tuple(weights)
        self.needs = tuple(needs_grad) + (False,) * (len(weights) - len(needs_grad))
        self.grads = WeightGradBuffers()
        # dBᵀ buffers (E, r, d_out) per B slot and their experts not written yet (module doc)
        self.grads_t: dict[int, tuple[torch.Tensor, list[bool]]] = {}

    def _times_b(self, rows_BO: torch.Tensor, name: str, offs_E1: torch.Tensor) -> torch.Tensor:
        """rows·B[e] (B, r) per expert: P (``b_down``) or Q (``b_up``), unscaled."""
        b_EOR = self.weights[self._slot(name)]
        if self.bounds is not None:  # eager: B with column-major (d_out, r) matrices (module doc)
            # NOTE(memory): E·d_out·r transient, freed after the product
            b_EOR = b_EOR.transpose(1, 2).contiguous().transpose(1, 2)
        return grouped_mm(rows_BO, b_EOR, offs_E1, self.backend)

    @property
    def needs_activation(self) -> bool:
        """A (recomputed) is needed for dA_down."""
        return self.spec.has_down and self.needs[-2]

    def _slot(self, name: str) -> int:
        order = [n for n, present in (("a_up", self.spec.has_up), ("b_up", self.spec.has_up),
                                      ("a_down", self.spec.has_down),
                                      ("b_down", self.spec.has_down)) if present]
        return order.index(name)

    def _accumulate(self, name: str, x_SI: torch.Tensor, grad_y_SO: torch.Tensor, r0: int,
                    offs_E1: torch.Tensor) -> None:
        slot = self._slot(name)
        if not self.needs[slot]:
            return
        like = self.weights[slot]
        if (name.startswith("b_") and self.bounds is not None
                and not uses_grouped_weight_grads(x_SI, grad_y_SO, like.shape[0], self.backend)):
            if slot not in self.grads_t:  # NOTE(memory): E·r·d_out, as dB's own buffer
                self.grads_t[slot] = (like.new_empty(like.shape[0], like.shape[2],
                                                     like.shape[1]), [True] * like.shape[0])
            grad_t_ERO, unwritten = self.grads_t[slot]
            accumulate_grouped_weight_grad_(grad_t_ERO, grad_y_SO, x_SI, self.bounds, r0,
                                            unwritten=unwritten)
            return
        self.grads.accumulate_(slot, like, x_SI, grad_y_SO, self.bounds, r0, offs_E1,
                               self.backend)

    def down_block(self, r0: int, r1: int, offs_E1: torch.Tensor, grad_out_BD: torch.Tensor,
                   grad_a_BN: torch.Tensor, a_BN: torch.Tensor | None,
                   w_B1: torch.Tensor) -> None:
        """Add the down adapter's term into dA (unweighted, in place) and its gradients.

        ``grad_out_BD``: the block's dO rows (not yet multiplied by w); ``a_BN``: recomputed A
        (needed when A_down needs a gradient).
        """
        if self.u_down is None:
            return
        s = self.spec.scale
        a_ERN = self.weights[self._slot("a_down")]
        p_BR = self._times_b(grad_out_BD, "b_down", offs_E1)
        mask = dropout_mask(self.spec, _DOWN, r0, r1, grad_a_BN.shape[1], grad_a_BN)
        grad_a_BN.add_(_masked(grouped_mm(p_BR, a_ERN, offs_E1, self.backend), mask), alpha=s)
        # dB_down[e] += s·dOᵀ·(w·U), dA_down[e] += s·(w·P)ᵀ·(m ⊙ A): (B, r) products only
        self._accumulate("b_down", grad_out_BD, self.u_down[r0:r1] * (w_B1 * s), r0, offs_E1)
        if self.needs[self._slot("a_down")]:
            assert a_BN is not None, "A is recomputed when A_down needs a gradient"
            self._accumulate("a_down", p_BR.mul_(w_B1 * s), _masked(a_BN, mask), r0, offs_E1)

    def up_block(self, r0: int, r1: int, offs_E1: torch.Tensor, grad_h_BG: torch.Tensor,
                 need_x: bool) -> torch.Tensor | None:
        """The up adapter's gradients for rows [r0, r1); returns its dx rows (B, d) or None."""
        if self.u_up is None:
            return None
        s = self.spec.scale
        a_ERD = self.weights[self._slot("a_up")]
        q_BR = self._times_b(grad_h_BG, "b_up", offs_E1).mul_(s)
        self._accumulate("b_up", grad_h_BG, self.u_up[r0:r1] * s, r0, offs_E1)
        mask = dropout_mask(self.spec, _UP, r0, r1, self.x_TD.shape[1], self.x_TD)
        if self.needs[self._slot("a_up")]:
            x_BD = gather_rows(self.x_TD, self.token_idx_S[r0:r1])  # NOTE(memory): B·d transient
            self._accumulate("a_up", q_BR, _masked(x_BD, mask), r0, offs_E1)
            del x_BD
        if not need_x:
            return None
        return _masked(grouped_mm(q_BR, a_ERD, offs_E1, self.backend), mask)

    def _take(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        if slot not in self.grads_t:
            return self.grads.take(slot, like)
        grad_t_ERO, unwritten = self.grads_t.pop(slot)
        for e in (e for e, fresh in enumerate(unwritten) if fresh):
            grad_t_ERO[e].zero_()  # an expert without rows: exact zeros
        # NOTE(memory): the contiguous (E, d_out, r) copy; the dBᵀ buffer is freed here
        return grad_t_ERO.transpose(1, 2).contiguous()

    def take_grads(self) -> tuple[Any, ...]:
        """The adapters' gradients in input order (None where not needed)."""
        return tuple(self._take(i, w) if self.needs[i] else None
                     for i, w in enumerate(self.weights))
