"""Optional Triton kernels for the expert path (extra ``memfine[triton]``).

Imported only when the ``triton`` backend is chosen; importing it without triton installed raises
ImportError naming the extra. Ops: :func:`grouped_mm` (grouped GEMM, any strides),
:func:`gather_up` (gather-fused up-projection with the activation in the epilogue) and
:func:`down_combine` (down-projection with the routing weight in the epilogue, then a per-token
combine). All are ``torch.library`` custom ops (``memfine::triton_*``) with fake impls.
"""

from memfine._optional import require

require("triton")

from memfine.triton_kernels.ops import down_combine, gather_up, grouped_mm, tile_schedule  # noqa: E402

__all__ = ["down_combine", "gather_up", "grouped_mm", "tile_schedule"]
