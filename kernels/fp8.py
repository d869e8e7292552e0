"""FP8 quantization with per-row scales: the operands of the FP8 LM head (``linear_cross_entropy(fp8=True)``).

For x [R, N] (any strides) and an fp8 format whose largest finite value is F (e4m3: 448, e5m2:
57344), per row r::

    amax_r  = max_n |x[r, n]|
    s_r     = amax_r / F                              (1 for an all-zero row)
    q[r, n] = fp8(clamp(x[r, n] * (F / amax_r), -F, F))   round to nearest even

so ``x[r, n] ~ s_r q[r, n]``, and a GEMM that contracts over n of two such operands is
``s_a[m] s_b[n]`` times the product of their fp8 values (``kernels.gemm.gemm`` with ``a_scale``
and ``b_scale``). Both divisions are IEEE-rounded (``div_rn``), the product with x is one fp32
multiply: a float32 PyTorch reference reproduces q and s exactly. Nothing here allocates a
float8 tensor on its own: ``q`` may be any float tensor (float32 under the interpreter, which
has no fp8 conversions, checks the scale math).

The quantized tensor's layout may differ from the input's: the quantized copy of ``W^T`` used as
the K-major operand of ``dx = g W`` is written from ``W [V, H]`` by passing ``W.t()`` as x and an
``[H, V]`` contiguous q; tiles of BLOCK_R x BLOCK_N are loaded along the input's unit stride and
stored along the output's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_tensor

#: the largest finite value of each fp8 format the kernels use
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: (mantissa bits, exponent of the smallest normal) of each format: its grid, for :func:`fp8_round`
FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
#: rows and columns of a quantization tile (GPU; 32 x 32 under the interpreter)
BLOCK_R, BLOCK_N = 32, 256


@triton.jit
def fp8_scales(amax, fp8_max):
    """(multiplier F / amax, dequantization scale amax / F) of rows whose largest |value| is
    ``amax`` (fp32); (1, 1) for an all-zero row."""
    nonzero = amax > 0.0
    safe = tl.where(nonzero, amax, 1.0)
    inv = tl.where(nonzero, tl.math.div_rn(tl.full(amax.shape, fp8_max, tl.float32), safe), 1.0)
    scale = tl.where(nonzero, tl.math.div_rn(safe, tl.full(amax.shape, fp8_max, tl.float32)), 1.0)
    return inv, scale


@triton.jit
def fp8_saturate(x, inv, fp8_max):
    """``clamp(x * inv, -F, F)`` in fp32: the value cast to fp8."""
    return tl.minimum(tl.maximum(x * inv, -fp8_max), fp8_max)


@triton.jit
def fp8_round(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``v`` (fp32, ``|v| <= F``) rounded to the nearest value of an fp8 grid, ties to even, kept in
    fp32: the emulation of the fp8 cast where there is none (the interpreter). The quantum of v's binade
    is ``2^(max(e, MIN_EXP) - MANTISSA)`` for its exponent e (read from the bits: exact); ``|v| / quantum``
    is below 2^(MANTISSA + 1), so adding and subtracting 2^23 rounds it to an integer, ties to even."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    quantum = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    steps = (tl.abs(v) / quantum + 8388608.0) - 8388608.0
    return tl.where(v < 0, -steps, steps) * quantum


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [R, N] input, strides (stride_xr, stride_xn)
    stride_xr, stride_xn,
    q_ptr,  # [R, N] out: quantized values, strides (stride_qr, stride_qn)
    stride_qr, stride_qn,
    scale_ptr,  # [R] fp32 out: dequantization scale per row
    R, N,
    fp8_max,  # F of q's format
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMULATE: tl.constexpr,  # q is fp32: round its values to the fp8 grid of (MANTISSA, MIN_EXP) (fp8_round)
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < R
    cols0 = tl.arange(0, BLOCK_N)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qr
    amax = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = mask_r[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols.to(tl.int64)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    inv, scale = fp8_scales(amax, fp8_max)
    tl.store(scale_ptr + rows, scale, mask=mask_r)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = mask_r[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols.to(tl.int64)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        q = fp8_saturate(x, inv[:, None], fp8_max)
        if EMULATE:
            q = fp8_round(q, MANTISSA, MIN_EXP)
        tl.store(q_rows + cols.to(tl.int64)[None, :] * stride_qn, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                       emulate: torch.dtype | None = None) -> None:
    """Quantize the rows of the 2-D ``x`` into ``q`` (same shape, any dtype and strides) with the
    dequantization scales in ``scale`` [R] (fp32), for a format of largest value ``fp8_max``.
    ``emulate`` (an fp8 dtype, q float32): q's values are also rounded to that format's grid."""
    R, N = x.shape
    if R == 0:
        return
    block_r, block_n = (32, 32) if interpreting() else (BLOCK_R, BLOCK_N)
    mantissa, min_exp = FP8_GRID[emulate] if emulate is not None else (0, 0)
    _quantize_rows_kernel[(triton.cdiv(R, block_r),)](
        x, x.stride(0), x.stride(1), q, q.stride(0), q.stride(1), scale, R, N, float(fp8_max),
        BLOCK_R=block_r, BLOCK_N=block_n, EMULATE=emulate is not None, MANTISSA=mantissa, MIN_EXP=min_exp)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: the 2-D ``x`` [R, N] quantized per row to the fp8 ``dtype`` (``float8_e4m3fn``
    or ``float8_e5m2``), q [R, N] contiguous, scale [R] fp32 with ``x ~ scale[:, None] * q``.
    A transposed view (``w.t()``) gives the quantized transpose, contiguous. Under the interpreter
    (no fp8 conversions) q is float32 holding the fp8 values exactly (:func:`fp8_round`)."""
    check_tensor("x", x, ndim=2)
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be one of {[str(d) for d in FP8_MAX]}, got {dtype}")
    emulate = dtype if interpreting() else None
    q = torch.empty(x.shape, dtype=torch.float32 if emulate else dtype, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    quantize_rows_into(x, q, scale, FP8_MAX[dtype], emulate)
    return q, scale
