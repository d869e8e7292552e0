"""RMSNorm over the last dimension, optionally fused with the residual add before it.

Forward, per row of ``x [..., N]`` (``h = x + residual`` rounded to x's dtype when a residual is
given, else ``h = x``), all math in fp32::

    rstd = 1 / sqrt(mean(h^2) + eps)          (saved for the backward, fp32, one per row)
    y    = h * rstd * w

Backward, with ``xhat = h * rstd``, ``g = dy * w`` and ``c = mean(xhat * g)`` per row::

    dh = rstd * (g - xhat * c)   (+ the gradient flowing into the returned h)
    dw = sum over rows of dy * xhat

With a residual, ``dx = dresidual = dh``. ``dw`` is deterministic: a persistent grid of programs
each accumulates the ``dy * xhat`` of its rows in fp32 registers and writes one partial row, then a
second kernel sums the partial rows in a fixed order (no atomics).

Rows up to ``_MAX_BLOCK_N`` elements are held in registers (one pass); longer rows loop over
chunks of ``_MAX_BLOCK_N`` (two passes over the row). Reference: Zhang & Sennrich, "Root Mean
Square Layer Normalization" (2019); Liger-Kernel ``ops/rms_norm.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_same_device, check_same_dtype, check_tensor, needs_grad, rows_view
from .device import num_sms
from .launch import Launch, Plans, next_pow2
from .custom_op import absent, compilable, compiled, define, fake, n_rows, register_formula

#: Longest row chunk held in registers; longer rows take the two-pass loop over chunks.
_MAX_BLOCK_N = 8192
#: Forward (fixed config, no autotune: the autotuner's per-call key building costs host time on a
#: pass that is ~13 us of GPU work): a program normalizes max(1, _FWD_TILE // BLOCK_N) rows with
#: one warp per 32 * _FWD_ELEMS_PER_THREAD elements of its tile.
_FWD_TILE = 4096
_FWD_ELEMS_PER_THREAD = 16
#: Backward (fixed, never timing-dependent: the rows each program sums into its dW partial, hence
#: the rounding, must not depend on a timing): persistent grid of _BWD_PROGRAMS_PER_SM programs per
#: SM, each taking tiles of max(1, _BWD_TILE // BLOCK_N) rows with one warp per
#: 32 * _BWD_ELEMS_PER_THREAD elements. With _BWD_PREFETCH a program loads its next tile before
#: the math of the current one (two tiles in flight: the old loop, 2 rows x 4 programs with no
#: overlap, ran at ~4x the bandwidth floor, 87 us against 18 at 16384x768 on H200).
#: Measured on an H200 (scripts/tune_memops.py): at 32768x4096 tile 4096 / 2 programs per SM runs
#: the backward at 3935 GB/s (92% of copy); at 16384x768 tile 2048 / 4 programs per SM takes 33.6 us
#: against 58.9 us for the wide setting, so rows of at most _BWD_NARROW_N use the narrow one.
_BWD_TILE, _BWD_PROGRAMS_PER_SM = 4096, 2
_BWD_NARROW_N, _BWD_NARROW_TILE, _BWD_NARROW_PROGRAMS_PER_SM = 1024, 2048, 4
_BWD_ELEMS_PER_THREAD = 16
_BWD_PREFETCH = True
#: Partial-dW reduction tile: [_DW_BLOCK_P partial rows, _DW_BLOCK_N columns]; narrow columns
#: give N / _DW_BLOCK_N programs (48 at N=768) to spread the reduction over more SMs.
_DW_BLOCK_P = 256
_DW_BLOCK_N = 16
#: Under the interpreter cost grows with the number of programs: one fixed, large tile.
_INTERP_TILE = 32768


@triton.jit
def _load_h(X, R, H, offs_x, offs_r, offs_h, mask,
            HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr):
    """h = x (+ residual, rounded to x's dtype and stored to H when STORE_H) as fp32."""
    h = tl.load(X + offs_x, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(R + offs_r, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        if STORE_H:
            tl.store(H + offs_h, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _rms_norm_fwd_kernel(
    X,          # [M, N] input rows, last dim contiguous
    R,          # [M, N] residual rows (read only when HAS_RESIDUAL)
    Y,          # [M, N] output, contiguous
    H,          # [M, N] output h = x + residual, contiguous (written only when HAS_RESIDUAL)
    W,          # [N] weight, contiguous
    RSTD,       # [M] fp32 output: 1 / sqrt(mean(h^2) + eps) (written only when STORE_RSTD)
    stride_x,   # row stride of X in elements
    stride_r,   # row stride of R in elements
    stride_y,   # row stride of Y in elements
    stride_h,   # row stride of H in elements
    M, N, eps,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RSTD: tl.constexpr,  # a backward will need rstd
    ONE_PASS: tl.constexpr,   # N <= BLOCK_N: the row stays in registers
    BLOCK_M: tl.constexpr,    # rows per program
    BLOCK_N: tl.constexpr,    # columns per chunk (power of two)
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_N)
    rows_x = rows[:, None] * stride_x
    rows_r = rows[:, None] * stride_r
    rows_y = rows[:, None] * stride_y
    rows_h = rows[:, None] * stride_h
    if ONE_PASS:
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        h = _load_h(X, R, H, rows_x + cols[None, :], rows_r + cols[None, :], rows_h + cols[None, :], mask,
                    HAS_RESIDUAL, True)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = h * rstd[:, None] * w[None, :]
        tl.store(Y + rows_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            h = _load_h(X, R, H, rows_x + c[None, :], rows_r + c[None, :], rows_h + c[None, :], mask,
                        HAS_RESIDUAL, True)
            acc += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(acc / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            col_mask = c < N
            mask = row_mask[:, None] & col_mask[None, :]
            h = _load_h(X, R, H, rows_x + c[None, :], rows_r + c[None, :], rows_h + c[None, :], mask,
                        HAS_RESIDUAL, False)
            w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)
            y = h * rstd[:, None] * w[None, :]
            tl.store(Y + rows_y + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _bwd_tile(DY, X, RSTD, rb, M, N, stride_dy, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row block ``rb`` of x and dy as stored (converted at use, so a prefetched tile stays packed)
    and its fp32 rstd; rows past M (a block past the last) are masked off and read nothing."""
    rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return x, dy, rstd


@triton.jit
def _rms_norm_bwd_kernel(
    DY,         # [M, N] gradient of y, last dim contiguous
    X,          # [M, N] the normalized input h (x, or x + residual), last dim contiguous
    W,          # [N] weight, contiguous
    RSTD,       # [M] fp32 rstd saved by the forward
    DH,         # [M, N] gradient flowing into the returned h (read only when HAS_DH)
    DX,         # [M, N] output gradient of h, contiguous
    C,          # [M] fp32 scratch for c = mean(xhat * dy * w) (used only when not ONE_PASS)
    PARTIAL,    # [num_programs, N] fp32 output: this program's sum of dy * xhat
    stride_dy,  # row stride of DY in elements
    stride_x,   # row stride of X in elements
    stride_dh,  # row stride of DH in elements
    stride_dx,  # row stride of DX in elements
    M, N,
    HAS_DH: tl.constexpr,
    ONE_PASS: tl.constexpr,   # N <= BLOCK_N: the tile holds whole rows
    PREFETCH: tl.constexpr,   # ONE_PASS only: load the next tile before this tile's math
    BLOCK_M: tl.constexpr,    # rows per tile
    BLOCK_N: tl.constexpr,    # columns per chunk (power of two)
):
    # Persistent: program p handles row blocks p, p + P, p + 2P, ... so that its dW partial
    # stays in registers; a program with no rows writes a zero partial.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(M, BLOCK_M)
    arange_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        col_mask = cols < N
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            x, dy, rstd = _bwd_tile(DY, X, RSTD, pid, M, N, stride_dy, stride_x, BLOCK_M, BLOCK_N)
        for rb in range(pid, n_row_blocks, n_programs):
            if PREFETCH:
                x_next, dy_next, rstd_next = _bwd_tile(DY, X, RSTD, rb + n_programs, M, N, stride_dy, stride_x,
                                                       BLOCK_M, BLOCK_N)
            else:
                x, dy, rstd = _bwd_tile(DY, X, RSTD, rb, M, N, stride_dy, stride_x, BLOCK_M, BLOCK_N)
            rows = (rb * BLOCK_M + arange_m).to(tl.int64)
            mask = (rows < M)[:, None] & col_mask[None, :]
            xhat = x.to(tl.float32) * rstd[:, None]
            dyf = dy.to(tl.float32)
            g = dyf * w[None, :]
            mean_xg = tl.sum(xhat * g, axis=1) / N
            dx = (g - xhat * mean_xg[:, None]) * rstd[:, None]
            if HAS_DH:
                dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dyf * xhat, axis=0)
            if PREFETCH:
                x, dy, rstd = x_next, dy_next, rstd_next
        tl.store(PARTIAL + pid.to(tl.int64) * N + cols, dw, mask=col_mask)
    else:
        # Rows longer than BLOCK_N: c per row first (into the C scratch), then dx and dW chunk by chunk.
        for rb in range(pid, n_row_blocks, n_programs):
            rows = (rb * BLOCK_M + arange_m).to(tl.int64)
            row_mask = rows < M
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                col_mask = c < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)
                acc += tl.sum(x * dy * w[None, :], axis=1)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            tl.store(C + rows, acc * rstd / N, mask=row_mask)
        tl.debug_barrier()
        for start in range(0, N, BLOCK_N):
            c = start + cols
            col_mask = c < N
            w = tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)
            dw = tl.zeros([BLOCK_N], dtype=tl.float32)
            for rb in range(pid, n_row_blocks, n_programs):
                rows = (rb * BLOCK_M + arange_m).to(tl.int64)
                row_mask = rows < M
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                xhat = x * rstd[:, None]
                g = dy * w[None, :]
                mean_xg = tl.load(C + rows, mask=row_mask, other=0.0)
                dx = (g - xhat * mean_xg[:, None]) * rstd[:, None]
                if HAS_DH:
                    dx += tl.load(DH + rows[:, None] * stride_dh + c[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + rows[:, None] * stride_dx + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                dw += tl.sum(dy * xhat, axis=0)
            tl.store(PARTIAL + pid.to(tl.int64) * N + c, dw, mask=col_mask)


@triton.jit
def _rms_norm_bwd_dw_kernel(
    PARTIAL,    # [P, N] fp32 partial dW rows, contiguous
    DW,         # [N] output weight gradient (weight's dtype)
    P, N,
    BLOCK_P: tl.constexpr,    # partial rows summed per step
    BLOCK_N: tl.constexpr,    # columns per program
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & col_mask[None, :]
        acc += tl.sum(tl.load(PARTIAL + p.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=col_mask)


def _warps(tile: int, per_thread: int) -> int:
    return min(16, max(1, tile // (32 * per_thread)))


@functools.lru_cache(maxsize=256)
def _fwd_plan(n: int, knobs: tuple) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_M, num_warps)`` of the forward for rows of ``n``; ``knobs`` are the module
    knobs it depends on (part of the cache key, so that setting a knob takes effect)."""
    max_block_n, tile, per_thread, interp_tile = knobs
    block_n = min(max(next_pow2(n), 16), max_block_n)
    if interpreting():
        return block_n, max(1, interp_tile // block_n), 4
    block_m = max(1, tile // block_n)
    return block_n, block_m, _warps(block_m * block_n, per_thread)


@functools.lru_cache(maxsize=256)
def _bwd_plan(m: int, n: int, device_index, knobs: tuple) -> tuple[int, ...]:
    """``(BLOCK_N, BLOCK_M, num_warps, programs, dW BLOCK_P, dW BLOCK_N)`` of the backward."""
    max_block_n, tile, per_thread, per_sm, dw_block_p, dw_block_n, interp_tile = knobs
    block_n = min(max(next_pow2(n), 16), max_block_n)
    if interpreting():
        block_m, num_warps = max(1, interp_tile // block_n), 4
    else:
        block_m = max(1, tile // block_n)
        num_warps = _warps(block_m * block_n, per_thread)
    programs = max(1, min(num_sms(device_index) * per_sm, triton.cdiv(m, block_m)))
    dw_block_p = min(dw_block_p, next_pow2(programs))
    if interpreting():
        dw_block_n = min(interp_tile // dw_block_p, next_pow2(n))
    return block_n, block_m, num_warps, programs, dw_block_p, dw_block_n


def _check_eps(eps) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def _check_fwd(x, weight, eps, residual) -> None:
    check_tensor("x", x, min_ndim=1)
    check_tensor("weight", weight, ndim=1)
    if residual is not None:
        check_tensor("residual", residual)
    check_same_device(x=x, weight=weight, residual=residual)
    check_same_dtype(x=x, residual=residual)
    n = x.shape[-1]
    if weight.shape[0] != n:
        raise ValueError(f"weight must have shape ({n},) to match the last dim of x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    _check_eps(eps)


#: forward and backward launch plans per problem (shape, row strides, flags, device, knobs)
_FWD_PLANS = Plans()
_BWD_PLANS = Plans()


def _fwd_launch(m: int, n: int, stride_x: int, stride_r: int, has_residual: bool, store_rstd: bool) -> Launch:
    knobs = (_MAX_BLOCK_N, _FWD_TILE, _FWD_ELEMS_PER_THREAD, _INTERP_TILE)
    key = (m, n, stride_x, stride_r, has_residual, store_rstd, knobs)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        block_n, block_m, num_warps = _fwd_plan(n, knobs)
        plan = _FWD_PLANS.add(key, Launch(
            _rms_norm_fwd_kernel, (triton.cdiv(m, block_m),), HAS_RESIDUAL=has_residual, STORE_RSTD=store_rstd,
            ONE_PASS=n <= block_n, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps))
    return plan


def _fwd(x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, eps: float, need_rstd: bool = True):
    """Unchecked forward on ``[M, N]`` row views (contiguous weight): ``(y, h or None, rstd or None)``;
    without ``need_rstd`` (no backward to come) rstd is neither allocated nor written."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    h = torch.empty((m, n), dtype=x2.dtype, device=x2.device) if r2 is not None else y
    rstd = torch.empty((m,), dtype=torch.float32, device=x2.device) if need_rstd else None
    if m > 0:
        r = r2 if r2 is not None else x2
        sx, sr = x2.stride(0), r.stride(0)
        _fwd_launch(m, n, sx, sr, r2 is not None, need_rstd)(
            x2, r, y, h, weight, y if rstd is None else rstd, sx, sr, n, n, m, n, float(eps))
    return y, (h if r2 is not None else None), rstd


def _bwd_launch(m: int, n: int, strides: tuple, has_dh: bool, device_index) -> tuple:
    """``(backward Launch, dW Launch, programs, ONE_PASS)`` of the backward of this problem."""
    tile, per_sm = ((_BWD_NARROW_TILE, _BWD_NARROW_PROGRAMS_PER_SM) if n <= _BWD_NARROW_N
                    else (_BWD_TILE, _BWD_PROGRAMS_PER_SM))
    knobs = (_MAX_BLOCK_N, tile, _BWD_ELEMS_PER_THREAD, per_sm, _DW_BLOCK_P, _DW_BLOCK_N, _INTERP_TILE)
    key = (m, n, strides, has_dh, device_index, knobs, _BWD_PREFETCH)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        block_n, block_m, num_warps, programs, dw_block_p, dw_block_n = _bwd_plan(m, n, device_index, knobs)
        one_pass = n <= block_n
        plan = _BWD_PLANS.add(key, (
            Launch(_rms_norm_bwd_kernel, (programs,), HAS_DH=has_dh, ONE_PASS=one_pass, PREFETCH=_BWD_PREFETCH,
                   BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps),
            Launch(_rms_norm_bwd_dw_kernel, (triton.cdiv(n, dw_block_n),), BLOCK_P=dw_block_p, BLOCK_N=dw_block_n),
            programs, one_pass))
    return plan


def _bwd(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh2: torch.Tensor | None):
    """Unchecked backward on ``[M, N]`` row views: ``(dx [M, N], dweight)``."""
    m, n = x2.shape
    dh = dh2 if dh2 is not None else dy2
    strides = (dy2.stride(0), x2.stride(0), dh.stride(0))
    bwd, dw_sum, programs, one_pass = _bwd_launch(m, n, strides, dh2 is not None, x2.device.index)
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    scratch = rstd if one_pass else torch.empty((m,), dtype=torch.float32, device=x2.device)
    bwd(dy2, x2, weight, rstd, dh, dx, scratch, partial, *strides, n, m, n)
    dw = torch.empty((n,), dtype=weight.dtype, device=weight.device)
    dw_sum(partial, dw, programs, n)
    return dx, dw


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 residual: torch.Tensor | None = None):
    """Launch the forward: returns ``(y, h, rstd)`` with ``y``/``h`` shaped like ``x`` (``h`` is
    ``x + residual``, or None without a residual) and ``rstd`` fp32 of shape ``[rows]``."""
    y, h, _, _, rstd = _forward(x, weight, eps, residual)
    return y, h, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 dh: torch.Tensor | None = None):
    """Launch the backward: returns ``(dx, dweight)``.

    ``x`` is the tensor that was normalized (``h = x + residual`` in the fused form), ``rstd`` the
    forward's fp32 ``[rows]`` output, ``dh`` an optional extra gradient of ``h`` added to ``dx``.
    """
    for name, t in (("dy", dy), ("x", x), ("weight", weight)):
        check_tensor(name, t)
    check_tensor("rstd", rstd, dtypes=(torch.float32,), ndim=1)
    if dh is not None:
        check_tensor("dh", dh)
    check_same_device(dy=dy, x=x, weight=weight, rstd=rstd, dh=dh)
    n = x.shape[-1]
    for name, grad in (("dy", dy), ("dh", dh)):
        if grad is not None and grad.shape != x.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(grad.shape)}")
    m = math.prod(x.shape[:-1])
    if weight.shape != (n,) or rstd.shape != (m,):
        raise ValueError(f"weight and rstd must have shapes ({n},) and ({m},), "
                         f"got {tuple(weight.shape)} and {tuple(rstd.shape)}")
    return _bwd_shaped(dy, x, weight, rstd, dh)


def _bwd_shaped(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                dh: torch.Tensor | None):
    """Unchecked :func:`rms_norm_bwd`: ``(dx shaped like x, dweight)``."""
    n = x.shape[-1]
    dx, dw = _bwd(rows_view(dy, n), rows_view(x, n), weight.contiguous(), rstd,
                  rows_view(dh, n) if dh is not None else None)
    return dx.view(x.shape), dw


def _forward(x, weight, eps, residual, need_rstd=True):
    """Checked forward of :func:`rms_norm`: ``(y, h or None, x or h as [M, N] rows, weight, rstd)``
    (rstd None without ``need_rstd``)."""
    _check_fwd(x, weight, eps, residual)
    n = x.shape[-1]
    x2 = rows_view(x, n)
    weight = weight.contiguous()
    y, h, rstd = _fwd(x2, rows_view(residual, n) if residual is not None else None, weight, eps, need_rstd)
    saved = h if h is not None else x2
    if x.dim() != 2:  # 2-D outputs already have x's shape (a view costs host time)
        y, h = y.view(x.shape), (h.view(x.shape) if h is not None else None)
    return y, h, saved, weight, rstd


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, residual = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)


def _rms_norm_backward(ctx, dy, dh=None, _drstd=None, *, bwd=_bwd_shaped):
    """``(dx, dweight, None, dresidual)`` by ``bwd``: the unchecked launcher eagerly (the forward checked
    the inputs), the backward op under torch.compile. ``dresidual`` is ``dx``; an output no loss reached
    has no gradient eagerly (``dy`` None: zeros)."""
    x, weight, rstd = ctx.saved_tensors
    dx, dw = bwd(dy if dy is not None else torch.zeros_like(x), x, weight, rstd, dh if ctx.has_residual else None)
    return dx, dw, None, (dx if ctx.has_residual else None)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: ``apply(x, weight, eps, residual)`` returns ``y``, or ``(y, h)`` with a residual.

    The forward checks the inputs; :func:`_rms_norm_setup` and :func:`_rms_norm_backward` (the custom op's
    formula too) save the normalized tensor and launch the backward without re-checking."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, h, _, _, rstd = _forward(x, weight, eps, residual)
        _rms_norm_setup(ctx, (x, weight, eps, residual), (y, h, rstd))
        ctx.set_materialize_grads(False)
        return (y, h) if h is not None else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        return _rms_norm_backward(ctx, dy, dh)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::rms_norm_fwd", mutates_args=())
def rms_norm_fwd_op(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h or absent, rstd)`` of :func:`kernels.rms_norm.rms_norm_fwd`."""
    y, h, rstd = rms_norm_fwd(x, weight, eps, residual)
    return y, (h if h is not None else absent(x)), rstd


@fake(rms_norm_fwd_op)
def _(x, weight, eps, residual):
    h = x.new_empty(x.shape) if residual is not None else absent(x)
    return x.new_empty(x.shape), h, x.new_empty(n_rows(x), dtype=torch.float32)


@define("tritonllm::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dh: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of :func:`kernels.rms_norm.rms_norm_bwd` (``x`` the normalized tensor)."""
    return rms_norm_bwd(dy, x, weight, rstd, dh)


@fake(rms_norm_bwd_op)
def _(dy, x, weight, rstd, dh):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


register_formula(rms_norm_fwd_op, _rms_norm_setup, _rms_norm_backward, bwd=rms_norm_bwd_op)


@compiled("rms_norm")
def _compiled_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Tensor | None = None):
    y, h, _ = rms_norm_fwd_op(x, weight, eps, residual)
    return (y, h) if residual is not None else y


@compilable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension: ``y = x / sqrt(mean(x^2, -1) + eps) * weight``.

    Args:
        x: ``[..., N]`` float32/float16/bfloat16; rows may be strided (last dim contiguous).
        weight: ``[N]`` any of those float dtypes.
        eps: added to the mean square.
        residual: optional ``[..., N]`` like ``x``: the fused add-and-norm computes
            ``h = x + residual`` and normalizes ``h`` in the same pass.

    Returns:
        ``y`` shaped and typed like ``x``; with ``residual``, the pair ``(y, h)``. Math and
        reductions in fp32. Gradients flow to ``x``, ``weight`` and ``residual`` (``dx = dresidual``,
        including what flows back into ``h``); ``dweight`` is reduced deterministically.
    """
    if needs_grad(x, weight, residual):
        return RMSNormFunction.apply(x, weight, eps, residual)
    y, h = _forward(x, weight, eps, residual, need_rstd=False)[:2]  # nothing to differentiate: no autograd node
    return (y, h) if h is not None else y
