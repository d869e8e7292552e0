"""Split a packed ``[B, T, H, D]`` projection into head groups without copying; Triton backward.

Forward: ``split_heads(x, sizes)`` returns views ``x[:, :, o_i:o_i + sizes[i]]`` (no kernel, no copy),
so q, k and v of a packed qkv projection reach RoPE and attention in place.

Backward: the gradients of the views ``g_i [B, T, sizes[i], D]`` are packed into one
``dx [B, T, sum(sizes), D]`` by a Triton kernel (autograd's own split backward would launch a
PyTorch concatenation): ``dx[:, :, o_i:o_i + sizes[i]] = g_i``; a view whose gradient is None gets
zeros. When the ``g_i`` already are consecutive head slices of one buffer (flash_attention's
backward writes dq, dk, dv so, and RoPE's in-place backward keeps them there), ``dx`` is a view
of that buffer: no kernel, no copy.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from .checks import check_tensor, needs_grad
from .launch import Launch, Plans, next_pow2
from .custom_op import compilable, compiled, define, fake

#: elements of one [rows, head, D] tile a program copies (16 KiB of bf16)
_TILE = 8192


@triton.jit
def _pack_heads_kernel(
    g_ptr,  # [B, T, Hg, D] gradient of one view (any strides, last dim contiguous)
    dx_ptr,  # [B*T, H, D] packed gradient, contiguous
    BT, T,  # rows B*T, sequence length
    stride_gb, stride_gt, stride_gh,  # strides of g
    H_OFF, HG, H,  # first head of the view in dx, heads of the view, heads of dx
    D: tl.constexpr,  # head dim
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # next_pow2(HG)
    BLOCK_D: tl.constexpr,  # next_pow2(D)
    ZERO: tl.constexpr,  # write zeros (the view got no gradient)
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (r < BT)[:, None, None] & (h < HG)[None, :, None] & (d < D)[None, None, :]
    r64 = r.to(tl.int64)
    dst = dx_ptr + (r64 * H * D)[:, None, None] + ((H_OFF + h) * D)[None, :, None] + d[None, None, :]
    if ZERO:
        tl.store(dst, tl.zeros([BLOCK_R, BLOCK_H, BLOCK_D], dx_ptr.dtype.element_ty), mask=mask)
    else:
        src = (g_ptr + ((r64 // T) * stride_gb + (r64 % T) * stride_gt)[:, None, None]
               + (h.to(tl.int64) * stride_gh)[None, :, None] + d[None, None, :])
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


#: launch plans per (shape, head group, source strides, zero fill, knob)
_PLANS = Plans()


def _adjacent(grads: list, sizes: list[int], dtype: torch.dtype) -> bool:
    """The gradients are consecutive head ranges of one buffer, laid out as the packed ``x``'s head
    groups (as flash_attention's backward writes dq, dk, dv): their concatenation is a view of it."""
    g0 = grads[0]
    if any(g is None for g in grads) or g0.dtype != dtype or g0.stride(-1) != 1 or g0.stride(2) != g0.shape[3]:
        return False
    step, ptr = g0.element_size() * g0.stride(2), g0.data_ptr()
    for g, hg in zip(grads, sizes):
        if g.stride() != g0.stride() or g.data_ptr() != ptr or g.untyped_storage().data_ptr() \
                != g0.untyped_storage().data_ptr():
            return False
        ptr += hg * step
    return True


def pack_heads(grads: list, sizes: list[int], shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``shape = [B, T, sum(sizes), D]`` holding ``grads[i]`` at its head range (zeros where None):
    a view without a copy when the gradients are already adjacent slices of one buffer."""
    B, T, H, D = shape
    if _adjacent(grads, sizes, dtype):
        return grads[0].as_strided(shape, grads[0].stride())
    dx = torch.empty((B, T, H, D), dtype=dtype, device=device)
    offset = 0
    for g, hg in zip(grads, sizes):
        if g is not None and g.stride(-1) != 1:
            g = g.contiguous()
        src = g if g is not None else dx
        strides = src.stride()[:3]
        key = (B, T, H, D, hg, offset, strides, g is None, _TILE)
        plan = _PLANS.get(key)
        if plan is None:
            block_h, block_d = next_pow2(hg), next_pow2(D)
            block_r = max(1, _TILE // (block_h * block_d))
            plan = _PLANS.add(key, Launch(_pack_heads_kernel, (triton.cdiv(B * T, block_r),), D=D, BLOCK_R=block_r,
                                          BLOCK_H=block_h, BLOCK_D=block_d, ZERO=g is None, num_warps=4))
        plan(src, dx, B * T, T, *strides, offset, hg, H)
        offset += hg
    return dx


class SplitHeadsFunction(torch.autograd.Function):
    """Views of head groups forward; one Triton pack kernel per group backward."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes, ctx.shape, ctx.dtype, ctx.device = sizes, x.shape, x.dtype, x.device
        outs, offset = [], 0
        for hg in sizes:
            outs.append(x[:, :, offset:offset + hg])
            offset += hg
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return pack_heads(list(grads), ctx.sizes, ctx.shape, ctx.dtype, ctx.device), None


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::pack_heads", mutates_args=())
def pack_heads_op(grads: list[Optional[Tensor]], sizes: list[int], like: Tensor) -> Tensor:
    """:func:`kernels.split_heads.pack_heads` into a tensor of ``like``'s shape, dtype and device."""
    return pack_heads(grads, sizes, like.shape, like.dtype, like.device)


@fake(pack_heads_op)
def _(grads, sizes, like):
    return like.new_empty(like.shape)


class _SplitHeads(torch.autograd.Function):
    """Views forward (traced as views), the pack op backward."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes = sizes
        ctx.save_for_backward(x)
        return tuple(x.split(sizes, dim=2))

    @staticmethod
    def backward(ctx, *grads):
        return pack_heads_op(list(grads), list(ctx.sizes), ctx.saved_tensors[0]), None


@compiled("split_heads")
def _compiled_split_heads(x: Tensor, sizes) -> tuple[Tensor, ...]:
    return _SplitHeads.apply(x, tuple(int(s) for s in sizes))


@compilable
def split_heads(x: torch.Tensor, sizes) -> tuple[torch.Tensor, ...]:
    """Split ``x [B, T, H, D]`` along the head axis into groups of ``sizes`` heads (``sum(sizes) == H``).

    Returns views (no copy); the backward packs the groups' gradients with a Triton kernel.
    """
    check_tensor("x", x, ndim=4)
    sizes = [int(s) for s in sizes]
    if any(s <= 0 for s in sizes) or sum(sizes) != x.shape[2]:
        raise ValueError(f"sizes must be positive and sum to the {x.shape[2]} heads of x, got {sizes}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    if needs_grad(x):
        return SplitHeadsFunction.apply(x, tuple(sizes))
    return tuple(x.split(sizes, dim=2))  # nothing to differentiate: the views without an autograd node
