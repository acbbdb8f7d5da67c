"""The itemised bytes of one MoE layer's forward + backward (:class:`MemoryBreakdown`).

Every field is an int in bytes with the tensor it counts and its source in the field's metadata
(:meth:`MemoryBreakdown.rows`); :func:`memfine.memory.layer.moe_layer_memory` fills it.
Legend as :mod:`memfine.memory.layer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _item(tensor: str, source: str) -> int:
    return field(default=0, metadata={"tensor": tensor, "source": source})


ASSUMPTIONS = (
    "one device: no expert parallelism, so no all-to-all buffers (all_to_all_bytes = 0)",
    "no padding mask (every token valid) and S = T·k received rows",
    "every score function, renormalisation, group limit, routed scaling factor and capacity "
    "are modelled; with capacity every pair is counted as kept (s″ = T·k, an upper "
    "bound when pairs are dropped); router_jitter_eps and seq_aux_loss_coef add router "
    "tensors not modelled here; shared experts are modelled",
    "scalar temporaries (at most 8 bytes) that die before the peak are left out",
    "measured protocol: x exists before and requires grad; parameters have no .grad; the "
    "caller keeps out and MoEAux; out and the two aux losses get gradients that exist before",
    "not modelled: allocator rounding and caching, fragmentation, CUDA context, kernel "
    "workspaces that never become tensors (BLAS packing, cuBLAS workspace)",
    "argsort index builder (T·E > 2^22 cells): its sort temporaries are approximated",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes of one MoE layer forward + backward, item by item (every field an int, in bytes).

    Saved items sum to ``saved_bytes``; the ``transient_*`` items are the largest chunk's
    workspaces (for reading, not summed); ``peak_bytes`` is the timeline's maximum of live bytes
    created inside forward + backward (saved activations, transients and the gradients created).
    ``total_bytes = parameter_bytes + optimizer_state_bytes + peak_bytes``.
    Each field's ``metadata`` names its tensor and source (see :meth:`rows`).
    """

    parameter_bytes: int = _item("w_up (E,d,G) + w_down (E,n,d) + router W_r (E,d), D_t",
                                 "MemFine Eq. 1 (parameters)")
    gradient_bytes: int = _item("their gradients, created in backward, D_t",
                                "MemFine Eq. 1 (gradients)")
    optimizer_state_bytes: int = _item("optimizer state per parameter (given)",
                                       "MemFine Eq. 1 (optimizer)")
    layer_input_bytes: int = _item("X (T,d) layer input, D_t", "MemFine Table 2; docs/design.md §5")
    top_k_index_bytes: int = _item("top-k selection (T,k) int64 saved by the router node "
                                   "(+ the capacity-masked index (T,k) int64)",
                                   "docs/design.md §2, §5")
    top_k_weights_bytes: int = _item("routing weights (T,k) D_t", "docs/design.md §5")
    pre_activation_bytes: int = _item("H (S,G) pre-activation, D_t",
                                      "MoEBlaze §5; MemFine Table 2 (FC1 output 2·s′·n)")
    routing_index_bytes: int = _item("expert_token_indices, expert_slot_indices (S), "
                                     "token_index_map (T·k), offsets (E+1), int32",
                                     "MoEBlaze §3-§4")
    gathered_input_bytes: int = _item("gathered X (S,d) D_t + its int64 row index (plain)",
                                      "MemFine Table 2 (dispatched input s′·d)")
    activation_output_bytes: int = _item("A (S,n) and act(gate) (S,n), D_t (plain)",
                                         "docs/design.md §5 (activation outputs)")
    combine_copy_bytes: int = _item("(T,k,d) slot rows + weights, masks, int64 index (plain)",
                                    "docs/design.md §5 (scattered Y); MemFine Table 2 (s′·d)")
    shared_expert_bytes: int = _item("shared experts: H (T·S, G_s) + int32 index arrays (fused) "
                                     "or the plain path's copies, as the routed items with k=S",
                                     "MoEBlaze §5 with k=S; DeepSeek-V3 §2.1.2")
    shared_weights_bytes: int = _item("shared weights: (T,S) ones or (T,1) gate, D_t; (S,) "
                                      "int64 index under recompute", "our derivation")
    saved_bytes: int = _item("sum of the saved items", "docs/style.md §7")
    transient_gathered_rows_bytes: int = _item("gathered X or dO rows (S_c,d) of one chunk",
                                               "docs/design.md §5")
    transient_pre_activation_grad_bytes: int = _item("dH (S_c,G) of one chunk", "docs/design.md §5")
    transient_expanded_dx_bytes: int = _item("(C,k,d) per-token gather of dx of one chunk",
                                             "docs/design.md §5 (expanded dx)")
    transient_index_build_bytes: int = _item("sort-free dense map (C,E+1) + scans (C,E) int64",
                                             "MoEBlaze §3")
    all_to_all_bytes: int = _item("dispatch/combine buffers (0 on one device)", "MemFine §4")
    forward_peak_bytes: int = _item("peak live bytes during forward", "our timeline")
    backward_peak_bytes: int = _item("peak live bytes during backward", "our timeline")
    peak_bytes: int = _item("peak live bytes of forward + backward", "our timeline")
    total_bytes: int = _item("parameters + optimizer state + peak", "MemFine Eq. 3 (left side)")
    assumptions: tuple[str, ...] = ASSUMPTIONS

    def rows(self) -> list[tuple[str, int, str, str]]:
        """``(field, bytes, tensor, source)`` for every int field, in declaration order."""
        return [(f.name, getattr(self, f.name), f.metadata["tensor"], f.metadata["source"])
                for f in dataclasses.fields(self) if f.name != "assumptions"]


SAVED_FIELDS = (
    "layer_input_bytes", "top_k_index_bytes", "top_k_weights_bytes", "pre_activation_bytes",
    "routing_index_bytes", "gathered_input_bytes", "activation_output_bytes",
    "combine_copy_bytes", "shared_expert_bytes", "shared_weights_bytes",
)
"""The :class:`MemoryBreakdown` fields that sum to ``saved_bytes``."""
