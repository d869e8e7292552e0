"""Squared ReLU, ``y = relu(x)^2``, elementwise with fp32 math (the MLP activation of Primer, So et
al. 2021, and of modded-nanogpt).

Forward: ``y = max(x, 0)^2``. Backward (from the saved input): ``dx = 2 max(x, 0) dy``.
The kernels see the operand as one flat contiguous run of elements; ``BLOCK`` per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import compilable
from ._elementwise import unary_op


@triton.jit
def _relu2_fwd_kernel(
    x_ptr,      # [N] input
    y_ptr,      # out: [N] relu(x)^2
    N,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    r = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(y_ptr + offs, (r * r).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_bwd_kernel(
    x_ptr,      # [N] forward input
    dy_ptr,     # [N] gradient of the output
    dx_ptr,     # out: [N] 2 relu(x) dy
    N,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    r = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (2.0 * r * dy).to(dx_ptr.dtype.element_ty), mask=mask)


# the launchers, the custom ops tritonllm::relu2_fwd / relu2_bwd for torch.compile (with their fakes, formula
# and compiled functional) and the eager functional: kernels/_elementwise.py's unary_op
relu2_fwd, relu2_bwd, _relu2 = unary_op("relu2", _relu2_fwd_kernel, _relu2_bwd_kernel)


@compilable
def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU ``relu(x)^2`` of a contiguous tensor (fp32 math), differentiable."""
    return _relu2(x)
