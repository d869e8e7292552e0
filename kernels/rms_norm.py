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

import torch
import triton
import triton.language as tl

from ._common import check_same_device, check_same_dtype, check_tensor, interpreting, next_pow2, num_sms, rows_view

#: Longest row chunk held in registers; longer rows take the two-pass loop over chunks.
_MAX_BLOCK_N = 8192
#: Forward, autotuned on (N, residual) over BLOCK_M x num_warps: configs are pruned to tiles
#: (BLOCK_M * BLOCK_N) of at most _FWD_MAX_TILE elements and _FWD_MAX_PER_THREAD per thread
#: (ptxas sm_90a: 64 per thread takes ~210 registers, 32 per thread 94-128).
_FWD_MAX_TILE = 16384
_FWD_MAX_PER_THREAD = 32
#: Backward (not autotuned: the rows each program sums into its dW partial, hence the rounding,
#: must not depend on a timing): rows of BLOCK_N gathered into tiles of at least _BWD_TILE
#: elements, with warps chosen for _BWD_ELEMS_PER_THREAD elements per thread (one 16-byte bf16
#: load). ptxas (sm_90a, triton 3.9) reports 64 registers at N=768 (tile [2, 1024], 8 warps), so
#: 4 programs fit on an SM; persistent grid of _BWD_PROGRAMS_PER_SM programs per SM.
_BWD_TILE = 2048
_BWD_ELEMS_PER_THREAD = 8
_BWD_PROGRAMS_PER_SM = 4
#: Partial-dW reduction tile: [_DW_BLOCK_P partial rows, _DW_BLOCK_N columns]; narrow columns
#: give N / 32 programs (24 at N=768) to spread the reduction over more SMs.
_DW_BLOCK_P = 128
_DW_BLOCK_N = 32
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
    RSTD,       # [M] fp32 output: 1 / sqrt(mean(h^2) + eps)
    stride_x,   # row stride of X in elements
    stride_r,   # row stride of R in elements
    stride_y,   # row stride of Y in elements
    stride_h,   # row stride of H in elements
    M, N, eps,
    HAS_RESIDUAL: tl.constexpr,
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
    tl.store(RSTD + rows, rstd, mask=row_mask)


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
    ONE_PASS: tl.constexpr,   # N <= BLOCK_N: c is computed from the row in registers
    BLOCK_M: tl.constexpr,    # rows per iteration
    BLOCK_N: tl.constexpr,    # columns per chunk (power of two)
):
    # Persistent: program p handles row blocks p, p + P, p + 2P, ... so that its dW partial
    # stays in registers; a program with no rows writes a zero partial.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(M, BLOCK_M)
    arange_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    if not ONE_PASS:
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
            if ONE_PASS:
                mean_xg = tl.sum(xhat * g, axis=1) / N
            else:
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


def _block_n(n: int) -> int:
    return min(max(next_pow2(n), 16), _MAX_BLOCK_N)


def _prune_fwd_configs(configs, named_args, **kwargs):
    block_n = {**named_args, **kwargs}["BLOCK_N"]
    return [c for c in configs
            if c.kwargs["BLOCK_M"] * block_n <= min(_FWD_MAX_TILE, _FWD_MAX_PER_THREAD * 32 * c.num_warps)]


_rms_norm_fwd_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": m}, num_warps=w) for m in (1, 2, 4, 8, 16) for w in (4, 8, 16)],
    key=["N", "HAS_RESIDUAL"],
    prune_configs_by={"early_config_prune": _prune_fwd_configs},
)(_rms_norm_fwd_kernel)


def _check_eps(eps) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 residual: torch.Tensor | None = None):
    """Launch the forward: returns ``(y, h, rstd)`` with ``y``/``h`` shaped like ``x`` (``h`` is
    ``x + residual``, or None without a residual) and ``rstd`` fp32 of shape ``[rows]``."""
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
    x2 = rows_view(x, n)
    r2 = rows_view(residual, n) if residual is not None else x2
    weight = weight.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = torch.empty((m, n), dtype=x.dtype, device=x.device) if residual is not None else y
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m > 0:
        block_n = _block_n(n)
        args = (x2, r2, y, h, weight, rstd, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0), m, n, float(eps))
        meta = dict(HAS_RESIDUAL=residual is not None, ONE_PASS=n <= block_n, BLOCK_N=block_n)
        if interpreting():
            block_m = max(1, _INTERP_TILE // block_n)
            _rms_norm_fwd_kernel[(triton.cdiv(m, block_m),)](*args, **meta, BLOCK_M=block_m)
        else:
            _rms_norm_fwd_tuned[lambda cfg: (triton.cdiv(m, cfg["BLOCK_M"]),)](*args, **meta)
    return y.view(x.shape), (h.view(x.shape) if residual is not None else None), rstd


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
    for name, t in (("dy", dy), ("dh", dh)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    x2 = rows_view(x, n)
    m = x2.shape[0]
    if weight.shape != (n,) or rstd.shape != (m,):
        raise ValueError(f"weight and rstd must have shapes ({n},) and ({m},), "
                         f"got {tuple(weight.shape)} and {tuple(rstd.shape)}")
    dy2 = rows_view(dy, n)
    dh2 = rows_view(dh, n) if dh is not None else dy2
    weight = weight.contiguous()
    block_n = _block_n(n)
    one_pass = n <= block_n
    if interpreting():
        block_m, num_warps = max(1, _INTERP_TILE // block_n), 4
    else:
        block_m = max(1, _BWD_TILE // block_n)
        num_warps = min(32, max(4, block_m * block_n // (32 * _BWD_ELEMS_PER_THREAD)))
    programs = max(1, min(num_sms(x.device.index) * _BWD_PROGRAMS_PER_SM, triton.cdiv(m, block_m)))
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    scratch = rstd if one_pass else torch.empty((m,), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, x2, weight, rstd, dh2, dx, scratch, partial,
        dy2.stride(0), x2.stride(0), dh2.stride(0), dx.stride(0), m, n,
        HAS_DH=dh is not None, ONE_PASS=one_pass, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    dw = torch.empty((n,), dtype=weight.dtype, device=weight.device)
    dw_block_p = min(_DW_BLOCK_P, next_pow2(programs))
    dw_block_n = min(_INTERP_TILE // dw_block_p, next_pow2(n)) if interpreting() else _DW_BLOCK_N
    _rms_norm_bwd_dw_kernel[(triton.cdiv(n, dw_block_n),)](
        partial, dw, programs, n, BLOCK_P=dw_block_p, BLOCK_N=dw_block_n)
    return dx.view(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: ``apply(x, weight, eps, residual)`` returns ``y``, or ``(y, h)`` with a residual."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, h, rstd = rms_norm_fwd(x, weight, eps, residual)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)
        ctx.set_materialize_grads(False)
        return (y, h) if ctx.has_residual else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, dh)
        return dx, dw, None, (dx if ctx.has_residual else None)


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
    return RMSNormFunction.apply(x, weight, eps, residual)
