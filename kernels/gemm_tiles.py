"""What the GEMM kernels share, below both of them: the epilogue codes and the grouped-M tile order of
:mod:`kernels.gemm`'s ``_matmul_kernel`` and :mod:`kernels.gemm_sm90`'s warp-specialized kernel (the
engine imports the Hopper kernel, never the reverse)."""

from __future__ import annotations

import triton
import triton.language as tl

#: GEMM epilogues (the ``epilogue`` argument of ``gemm.gemm``).
PLAIN, SWIGLU_FWD = 0, 1


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Row and column tile of ``tile_id`` in grouped-M order: GROUP_M row tiles sweep every
    column tile before the next group starts (the Gluon kernel of gemm_sm90 compiles it too)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id % tiles_per_group
    return first_m + local % group_size, local // group_size
