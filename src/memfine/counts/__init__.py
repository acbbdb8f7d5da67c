"""What a GPU would pay, counted on the CPU: ATen ops and host syncs priced at a GPU's roofline.

- :mod:`memfine.counts.ops_count`: :class:`OpCounter`, a ``TorchDispatchMode`` counting non-view
  ATen ops, host syncs by kind and ``torch._grouped_mm`` calls, per phase (:class:`PhaseCounts`).
- :mod:`memfine.counts.grouped_mm_rules`: CUDA's fast-path rules for one ``_grouped_mm`` call.
- :mod:`memfine.counts.roofline`: FLOPs and HBM bytes per op, a stream's floor per GPU.

Reference: docs/design.md §8.
"""

from memfine.counts.grouped_mm_rules import GroupedMMCall, cuda_grouped_mm_call
from memfine.counts.ops_count import OpCounter, PhaseCounts

__all__ = ["GroupedMMCall", "OpCounter", "PhaseCounts", "cuda_grouped_mm_call"]
