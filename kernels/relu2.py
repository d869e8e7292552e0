"""Squared ReLU, ``y = relu(x)^2``, elementwise with fp32 math (the MLP activation of Primer, So et
al. 2021, and of modded-nanogpt).

Forward: ``y = max(x, 0)^2``. Backward (from the saved input): ``dx = 2 max(x, 0) dy``.
The kernels see the operand as one flat contiguous run of elements; ``BLOCK`` per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import needs_grad
from .custom_op import compilable
from ._elementwise import elementwise_bwd, elementwise_fwd, input_saving_function, unary_ops


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


def relu2_fwd(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` of a contiguous fp32/fp16/bf16 tensor, in its dtype."""
    return elementwise_fwd(_relu2_fwd_kernel, x)


def relu2_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``2 relu(x) dy`` (``dy`` made contiguous), in ``x``'s dtype."""
    return elementwise_bwd(_relu2_bwd_kernel, x, "x", dy)


Relu2Function = input_saving_function("Relu2Function", relu2_fwd, relu2_bwd)


# custom ops for torch.compile (kernels/custom_op.py): tritonllm::relu2_fwd / relu2_bwd, their fakes and
# formula, and the compiled functional, which @compilable sends the public functional to while torch.compile traces
relu2_fwd_op, relu2_bwd_op = unary_ops("relu2", relu2_fwd, relu2_bwd)


@compilable
def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU ``relu(x)^2`` of a contiguous tensor (fp32 math), differentiable."""
    if needs_grad(x):
        return Relu2Function.apply(x)
    return relu2_fwd(x)
