"""Squared ReLU, ``y = relu(x)^2``, elementwise with fp32 math (the MLP activation of Primer, So et
al. 2021, and of modded-nanogpt).

Forward: ``y = max(x, 0)^2``. Backward (from the saved input): ``dx = 2 max(x, 0) dy``.
The kernels see the operand as one flat contiguous run of elements; ``BLOCK`` per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_same_device, check_same_dtype, check_tensor, interpreting, needs_grad

#: elements per program and warps on the GPU (memory-bound; not measured yet)
_BLOCK, _NUM_WARPS = 4096, 8
#: under the interpreter the cost is per program: large blocks
_INTERP_BLOCK = 65536


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


def _block() -> int:
    return _INTERP_BLOCK if interpreting() else _BLOCK


def relu2_fwd(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` of a contiguous fp32/fp16/bf16 tensor, in its dtype."""
    check_tensor("x", x)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        block = _block()
        _relu2_fwd_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, num_warps=_NUM_WARPS)
    return y


def relu2_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``2 relu(x) dy`` (``dy`` made contiguous), in ``x``'s dtype."""
    check_tensor("dy", dy)
    check_same_device(x=x, dy=dy)
    check_same_dtype(x=x, dy=dy)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n = x.numel()
    if n:
        block = _block()
        _relu2_bwd_kernel[(triton.cdiv(n, block),)](x, dy, dx, n, BLOCK=block, num_warps=_NUM_WARPS)
    return dx


class Relu2Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return relu2_fwd(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return relu2_bwd(x, dy)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU ``relu(x)^2`` of a contiguous tensor (fp32 math), differentiable."""
    if needs_grad(x):
        return Relu2Function.apply(x)
    return relu2_fwd(x)
