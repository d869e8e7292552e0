"""Scalar-weighted sums of two activations, and forks: the value-residual mix of value embeddings
and the gated U-net skips (modded-nanogpt), with learned scalar weights and deterministic gradients.

``weighted_add(x, y, w)``, x and y ``[..., N]`` of one shape (rows may be strided, the last
dimension contiguous), ``w`` a 1-D tensor of one or two weights::

    w = [b]:     out = x + b y             dx = dout        dy = b dout    db = sum(dout * y)
    w = [a, b]:  out = a x + b y           dx = a dout      dy = b dout    da = sum(dout * x), db = sum(dout * y)

The weights' gradients are reduced without atomics: each backward program writes its tile's fp32
partial sums, then one program adds them in a fixed order (bitwise reproducible).

``fork(x) -> (x, x)``: the same tensor to two consumers (aliases, nothing copied); the backward
adds the two gradients in one Triton launch, where autograd would otherwise sum them with a
PyTorch add. ``add_fork(x, y) -> (x, y, x + y)``: passes a residual stream held as two pending
terms through and materialises their sum for a second consumer (a U-net skip); backward
``dx = gx + gs``, ``dy = gy + gs``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_same_device, check_same_dtype, check_tensor, needs_grad, rows_view
from .custom_op import absent, compilable, compiled, define, fake, formula_function, given, register_formula

#: tile of rows x columns per program on the GPU (memory-bound; not measured yet), and under the
#: interpreter (cost per program: large tiles)
_BLOCK_M, _BLOCK_N, _NUM_WARPS = 16, 256, 4
_INTERP_BLOCK_M, _INTERP_BLOCK_N = 64, 1024


@triton.jit
def _weighted_add_fwd_kernel(
    x_ptr,  # [M, N] first operand (row stride stride_x)
    y_ptr,  # [M, N] second operand (row stride stride_y)
    w_ptr,  # [WEIGHTS] weights: [b] or [a, b] (unused when WEIGHTS == 0)
    out_ptr,  # [M, N] out: a x + b y (contiguous)
    M, N, stride_x, stride_y,
    WEIGHTS: tl.constexpr,  # 0: x + y; 1: x + b y; 2: a x + b y
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if WEIGHTS == 2:
        out = tl.load(w_ptr).to(tl.float32) * x + tl.load(w_ptr + 1).to(tl.float32) * y
    elif WEIGHTS == 1:
        out = x + tl.load(w_ptr).to(tl.float32) * y
    else:
        out = x + y
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_add_bwd_kernel(
    dout_ptr,  # [M, N] gradient of the output (row stride stride_d)
    x_ptr,  # [M, N] forward's x (row stride stride_x; read when WEIGHTS == 2)
    y_ptr,  # [M, N] forward's y (row stride stride_y)
    w_ptr,  # [WEIGHTS] weights
    dx_ptr,  # [M, N] out: a dout (contiguous; written when WEIGHTS == 2 and NEED_DX)
    dy_ptr,  # [M, N] out: b dout (contiguous; written when NEED_DY)
    part_ptr,  # [programs, 2] fp32 out: this tile's sum(dout * x), sum(dout * y) (NEED_DW)
    M, N, stride_d, stride_x, stride_y,
    WEIGHTS: tl.constexpr,  # 1 or 2
    NEED_DX: tl.constexpr,
    NEED_DY: tl.constexpr,
    NEED_DW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    out_offs = rows[:, None] * N + cols[None, :]
    d = tl.load(dout_ptr + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(w_ptr + WEIGHTS - 1).to(tl.float32)
    if NEED_DY:
        tl.store(dy_ptr + out_offs, (b * d).to(dy_ptr.dtype.element_ty), mask=mask)
    if WEIGHTS == 2:
        if NEED_DX:
            tl.store(dx_ptr + out_offs, (tl.load(w_ptr).to(tl.float32) * d).to(dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(part_ptr + 2 * pid + 1, tl.sum(tl.sum(d * y, axis=1), axis=0))
        if WEIGHTS == 2:
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(part_ptr + 2 * pid, tl.sum(tl.sum(d * x, axis=1), axis=0))


@triton.jit
def _weighted_add_dw_kernel(
    part_ptr,  # [P, 2] fp32 per-program partial sums
    dw_ptr,  # [WEIGHTS] out: the weights' gradients, in their dtype
    P,
    WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    acc_x = tl.zeros((BLOCK,), tl.float32)
    acc_y = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, P, BLOCK):
        p = start + offs
        acc_y += tl.load(part_ptr + 2 * p + 1, mask=p < P, other=0.0)
        if WEIGHTS == 2:
            acc_x += tl.load(part_ptr + 2 * p, mask=p < P, other=0.0)
    if WEIGHTS == 2:
        tl.store(dw_ptr, tl.sum(acc_x, axis=0).to(dw_ptr.dtype.element_ty))
    tl.store(dw_ptr + WEIGHTS - 1, tl.sum(acc_y, axis=0).to(dw_ptr.dtype.element_ty))


def _tiles() -> tuple[int, int]:
    return (_INTERP_BLOCK_M, _INTERP_BLOCK_N) if interpreting() else (_BLOCK_M, _BLOCK_N)


def _check_pair(x: torch.Tensor, y: torch.Tensor) -> None:
    check_tensor("x", x, min_ndim=1)
    check_tensor("y", y, min_ndim=1)
    check_same_device(x=x, y=y)
    check_same_dtype(x=x, y=y)
    if x.shape != y.shape:
        raise ValueError(f"y has shape {tuple(y.shape)} but x has {tuple(x.shape)}")


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    check_tensor("weight", weight, ndim=1)
    check_same_device(x=x, weight=weight)
    if weight.numel() not in (1, 2):
        raise ValueError(f"weight must hold 1 ([b]: x + b y) or 2 ([a, b]: a x + b y) weights, got {weight.numel()}")


def weighted_add_fwd(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``a x + b y`` (``weight`` [a, b]), ``x + b y`` ([b]) or ``x + y`` (None): a new contiguous tensor
    of x's shape and dtype."""
    _check_pair(x, y)
    if weight is not None:
        _check_weight(weight, x)
    N = x.shape[-1]
    x2, y2 = rows_view(x, N), rows_view(y, N)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and N:
        bm, bn = _tiles()
        _weighted_add_fwd_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x2, y2, x2 if weight is None else weight, out, M, N, x2.stride(0), y2.stride(0),
            WEIGHTS=0 if weight is None else weight.numel(), BLOCK_M=bm, BLOCK_N=bn, num_warps=_NUM_WARPS)
    return out


def weighted_add_bwd(dout, x, y, weight, need_dx=True, need_dy=True, need_dw=True):
    """(dx, dy, dweight) of :func:`weighted_add` (each None unless needed; dx is ``dout`` itself for
    a one-weight sum)."""
    N = dout.shape[-1]
    d2, x2, y2 = rows_view(dout, N), rows_view(x, N), rows_view(y, N)
    M, W = d2.shape[0], weight.numel()
    bm, bn = _tiles()
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    dx = (torch.empty(x.shape, dtype=x.dtype, device=x.device) if W == 2 else dout) if need_dx else None
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device) if need_dy else None
    dw = torch.empty_like(weight) if need_dw else None
    part = torch.empty((grid[0] * grid[1], 2), dtype=torch.float32, device=x.device) if need_dw else None
    if M and N:
        _weighted_add_bwd_kernel[grid](
            d2, x2, y2, weight, d2 if dx is None or W == 1 else dx, d2 if dy is None else dy,
            d2 if part is None else part, M, N, d2.stride(0), x2.stride(0), y2.stride(0),
            WEIGHTS=W, NEED_DX=need_dx, NEED_DY=need_dy, NEED_DW=need_dw, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=_NUM_WARPS)
    if need_dw:
        P = grid[0] * grid[1] if M and N else 0
        _weighted_add_dw_kernel[(1,)](part, dw, P, WEIGHTS=W, BLOCK=1024)
    return dx, dy, dw


def _weighted_add_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _weighted_add_backward(ctx, dout, *, bwd=weighted_add_bwd):
    """``(dx, dy, dweight)`` by ``bwd``: the launcher eagerly, the backward op under torch.compile (which
    gives no dx for a one-weight sum: it is ``dout`` itself)."""
    x, y, weight = ctx.saved_tensors
    need_dx, need_dy, need_dw = ctx.needs_input_grad
    dx, dy, dw = bwd(dout, x, y, weight, need_dx, need_dy, need_dw)
    if need_dx and weight.numel() == 1:
        dx = dout
    return given(dx, need_dx), given(dy, need_dy), given(dw, need_dw)


WeightedAddFunction = formula_function("WeightedAddFunction", weighted_add_fwd, _weighted_add_setup, _weighted_add_backward)


@compilable
def weighted_add(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[0] * x + weight[1] * y`` (``weight`` of two elements) or ``x + weight[0] * y`` (one),
    fp32 math, differentiable in x, y and weight (deterministic weight gradients).

    x, y ``[..., N]`` of one shape and dtype, the last dimension contiguous (rows may be strided: a
    head slice of a packed projection); weight 1-D on their device. Returns a new contiguous tensor.
    """
    if needs_grad(x, y, weight):
        return WeightedAddFunction.apply(x, y, weight)
    return weighted_add_fwd(x, y, weight)


def sum_grads(a: torch.Tensor | None, b: torch.Tensor | None, add=weighted_add_fwd) -> torch.Tensor | None:
    """a + b in one launch (``add(a, b, None)``: the compiled fork passes its op); the other when one is
    None (autograd's None: no gradient flowed)."""
    if a is None or b is None:
        return b if a is None else a
    return add(a, b, None)


class ForkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx, g1, g2):
        return sum_grads(g1, g2)


@compilable
def fork(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, x)``: two aliases of ``x`` for two consumers; their gradients are summed by a Triton
    kernel in the backward. Without autograd both are ``x``."""
    check_tensor("x", x)
    if needs_grad(x):
        return ForkFunction.apply(x)
    return x, x


class AddForkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x.view_as(x), y.view_as(y), weighted_add_fwd(x, y, None)

    @staticmethod
    def backward(ctx, gx, gy, gs):
        return sum_grads(gx, gs), sum_grads(gy, gs)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::weighted_add_fwd", mutates_args=())
def weighted_add_fwd_op(x: Tensor, y: Tensor, weight: Optional[Tensor]) -> Tensor:
    """:func:`kernels.residual_mix.weighted_add_fwd`."""
    return weighted_add_fwd(x, y, weight)


@fake(weighted_add_fwd_op)
def _(x, y, weight):
    return x.new_empty(x.shape)


@define("tritonllm::weighted_add_bwd", mutates_args=())
def weighted_add_bwd_op(dout: Tensor, x: Tensor, y: Tensor, weight: Tensor, need_dx: bool, need_dy: bool,
                        need_dw: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dy, dweight)`` of :func:`kernels.residual_mix.weighted_add_bwd`, absent where not needed;
    dx is absent for a one-weight sum too (it is ``dout`` itself, which an op may not return)."""
    dx, dy, dw = weighted_add_bwd(dout, x, y, weight, need_dx and weight.numel() == 2, need_dy, need_dw)
    dx, dy, dw = (g if g is not None else absent(x) for g in (dx, dy, dw))
    return dx, dy, dw


@fake(weighted_add_bwd_op)
def _(dout, x, y, weight, need_dx, need_dy, need_dw):
    return (x.new_empty(x.shape) if need_dx and weight.numel() == 2 else absent(x),
            y.new_empty(y.shape) if need_dy else absent(x), weight.new_empty(weight.shape) if need_dw else absent(x))


register_formula(weighted_add_fwd_op, _weighted_add_setup, _weighted_add_backward, bwd=weighted_add_bwd_op)


@compiled("weighted_add")
def _compiled_weighted_add(x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
    return weighted_add_fwd_op(x, y, weight)


class _Fork(ForkFunction):
    """ForkFunction (aliases forward, traced as views) with its gradients summed by the weighted_add op."""

    @staticmethod
    def backward(ctx, g1, g2):
        return sum_grads(g1, g2, weighted_add_fwd_op)


class _AddFork(AddForkFunction):
    """AddForkFunction with its sum and its gradients' sums by the weighted_add op."""

    @staticmethod
    def forward(ctx, x, y):
        return x.view_as(x), y.view_as(y), weighted_add_fwd_op(x, y, None)

    @staticmethod
    def backward(ctx, gx, gy, gs):
        return sum_grads(gx, gs, weighted_add_fwd_op), sum_grads(gy, gs, weighted_add_fwd_op)


@compiled("fork")
def _compiled_fork(x: Tensor) -> tuple[Tensor, Tensor]:
    return _Fork.apply(x)


@compiled("add_fork")
def _compiled_add_fork(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _AddFork.apply(x, y)


@compilable
def add_fork(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, x + y)``: x and y passed through (aliases) and their sum materialised (new contiguous
    tensor) for another consumer; backward ``dx = gx + gs``, ``dy = gy + gs`` in Triton."""
    if needs_grad(x, y):
        return AddForkFunction.apply(x, y)
    return x, y, weighted_add_fwd(x, y, None)
