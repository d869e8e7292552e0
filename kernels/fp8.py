"""FP8 quantization with per-row scales: the operands of the FP8 linear layers (``kernels.fp8_linear``)
and of the FP8 LM head (``linear_cross_entropy(fp8=True)``).

For x [R, C] (any strides) and an fp8 format whose largest finite value is F (e4m3: 448, e5m2:
57344), per row r::

    amax_r  = max_c |x[r, c]|
    s_r     = amax_r / F                              (1 for an all-zero row)
    q[r, c] = fp8(clamp(x[r, c] * (F / amax_r), -F, F))   round to nearest even

so ``x[r, c] ~ s_r q[r, c]``, and a GEMM that contracts over c of two such operands is
``s_a[m] s_b[n]`` times the product of their fp8 values (``kernels.gemm.gemm`` with ``a_scale``
and ``b_scale``). Both divisions are IEEE-rounded (``div_rn``), the product with x is one fp32
multiply: a float32 PyTorch reference reproduces q and s exactly. Nothing here allocates a
float8 tensor on its own: ``q`` may be any float tensor (float32 under the interpreter, which
has no fp8 conversions, checks the scale math).

The same per column (x^T's rows) gives the K-major operand of a GEMM that contracts over R: the
dW = dy^T x of a linear layer needs dy and x per column, dx = dy W needs W per column. A layer
needs x per row (forward) and per column (dW), so :func:`quantize_into` writes both layouts from
two passes over x (the tiles' amax, then the tiles quantized each way), where two row-only
quantizations of x and x^T read it four times. Tiles of BLOCK_R x BLOCK_C are spread over the whole
GPU whatever the shape (a weight's 2048 rows are 32 programs as rows, 1024 as tiles).
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
#: rows and columns of a quantization tile and the warps of its program (GPU; 32 x 32 under the interpreter)
BLOCK_R, BLOCK_C, QUANT_WARPS = 64, 64, 4
#: the amax pass: its tile, the tiles down the rows a program takes (its columns' max merged in registers,
#: one atomic per column per program), and its warps; ``scripts/tune_memops.py --ops fp8`` times the choices
AMAX_BLOCK_R, AMAX_BLOCK_C, AMAX_ROW_TILES, AMAX_WARPS = 64, 64, 1, 4


@triton.jit
def fp8_scales(amax, fp8_max):
    """(multiplier F / amax, dequantization scale amax / F) of rows whose largest |value| is
    ``amax`` (fp32); (1, 1) for an all-zero row. A NaN amax gives NaN for both and an infinite one a
    scale of inf, so a row holding inf or NaN comes out of the GEMM not finite (never silently finite)."""
    zero = amax == 0.0
    safe = tl.where(zero, 1.0, amax)
    inv = tl.where(zero, 1.0, tl.math.div_rn(tl.full(amax.shape, fp8_max, tl.float32), safe))
    scale = tl.where(zero, 1.0, tl.math.div_rn(safe, tl.full(amax.shape, fp8_max, tl.float32)))
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
def _amax_kernel(
    x_ptr,  # [R, C] input, strides (stride_xr, stride_xc)
    stride_xr, stride_xc,
    amax_ptr,  # int32 [R + C], zeros in: max |x| of each row (first R), of each column (last C), as fp32 bits
    R, C,
    ROWS: tl.constexpr,  # the rows' amax
    COLS: tl.constexpr,  # the columns' amax
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROW_TILES: tl.constexpr,  # tiles down the rows, one after the other
):
    """ROW_TILES tiles of BLOCK_R x BLOCK_C, one under the other: each tile's rows' max |x| and, once for
    all of them, their columns' merged into the totals by atomic max on the fp32 bits (|x| >= 0 orders as
    its bits do; a NaN's bits are above inf's, so NaN wins: exact and order-free, hence deterministic)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_bits = tl.zeros([BLOCK_C], dtype=tl.int32)
    for i in tl.static_range(ROW_TILES):
        rows = (tl.program_id(0) * ROW_TILES + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols.to(tl.int64)[None, :] * stride_xc,
                    mask=mask, other=0.0)
        bits = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)
        if ROWS:
            tl.atomic_max(amax_ptr + rows, tl.max(bits, axis=1), mask=rows < R)
        if COLS:
            col_bits = tl.maximum(col_bits, tl.max(bits, axis=0))
    if COLS:
        tl.atomic_max(amax_ptr + R + cols, col_bits, mask=cols < C)


@triton.jit
def _quantize_tile(x, amax_bits, stride_major, stride_minor, major, minor, n_major, mask, q_ptr, scale_ptr,
                   store_scale, fp8_max, EMULATE: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """q[major, minor] = fp8(x * F / amax[major]) for a tile x [len(major), len(minor)] (transposed by the
    caller for the columns); the scales of the ``n_major`` rows stored if ``store_scale`` (the first block)."""
    inv, scale = fp8_scales(amax_bits.to(tl.float32, bitcast=True), fp8_max)
    if store_scale:
        tl.store(scale_ptr + major, scale, mask=major < n_major)
    q = fp8_saturate(x, inv[:, None], fp8_max)
    if EMULATE:
        q = fp8_round(q, MANTISSA, MIN_EXP)
    tl.store(q_ptr + major.to(tl.int64)[:, None] * stride_major + minor.to(tl.int64)[None, :] * stride_minor,
             q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_kernel(
    x_ptr,  # [R, C] input, strides (stride_xr, stride_xc)
    stride_xr, stride_xc,
    amax_ptr,  # int32 [R + C]: _amax_kernel's totals
    q_ptr,  # ROWS: [R, C] out, x quantized per row, strides (stride_qr, stride_qc)
    stride_qr, stride_qc,
    scale_ptr,  # ROWS: [R] fp32 out, the rows' dequantization scales
    qt_ptr,  # COLS: [C, R] out, x^T quantized per row (x per column), strides (stride_tc, stride_tr)
    stride_tc, stride_tr,
    scale_t_ptr,  # COLS: [C] fp32 out, the columns' dequantization scales
    R, C,
    fp8_max,  # F of q's format
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EMULATE: tl.constexpr,  # q is fp32: round its values to the fp8 grid of (MANTISSA, MIN_EXP) (fp8_round)
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    """One tile read once, written quantized per row and/or per column (each in its own layout)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols.to(tl.int64)[None, :] * stride_xc,
                mask=mask, other=0.0).to(tl.float32)
    if ROWS:
        bits = tl.load(amax_ptr + rows, mask=rows < R, other=0)
        _quantize_tile(x, bits, stride_qr, stride_qc, rows, cols, R, mask, q_ptr, scale_ptr, pid_c == 0, fp8_max,
                       EMULATE, MANTISSA, MIN_EXP)
    if COLS:
        bits = tl.load(amax_ptr + R + cols, mask=cols < C, other=0)
        _quantize_tile(tl.trans(x), bits, stride_tc, stride_tr, cols, rows, C, tl.trans(mask), qt_ptr, scale_t_ptr,
                       pid_r == 0, fp8_max, EMULATE, MANTISSA, MIN_EXP)


def quantize_into(x: torch.Tensor, fp8_max: float, q: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  qt: torch.Tensor | None = None, scale_t: torch.Tensor | None = None,
                  emulate: torch.dtype | None = None) -> None:
    """Quantize the 2-D ``x`` [R, C] for a format of largest value ``fp8_max``: per row into ``q`` [R, C]
    with the dequantization scales in ``scale`` [R] (fp32), and/or per column into ``qt`` [C, R] (x^T's
    rows) with ``scale_t`` [C]; q and qt of any dtype and strides. Two passes, each reading x once: the
    rows' and columns' amax of every tile (atomic max), then every tile quantized both ways, so both
    layouts cost what one did. ``emulate`` (an fp8 dtype, q float32): q's values are also rounded to
    that format's grid."""
    R, C = x.shape
    rows, cols = q is not None, qt is not None
    if R == 0 or C == 0 or not (rows or cols):
        return
    interp = interpreting()
    block_r, block_c = (32, 32) if interp else (BLOCK_R, BLOCK_C)
    amax_r, amax_c, row_tiles = (32, 32, 2) if interp else (AMAX_BLOCK_R, AMAX_BLOCK_C, AMAX_ROW_TILES)
    mantissa, min_exp = FP8_GRID[emulate] if emulate is not None else (0, 0)
    amax = torch.zeros(R + C, dtype=torch.int32, device=x.device)
    _amax_kernel[(triton.cdiv(R, amax_r * row_tiles), triton.cdiv(C, amax_c))](
        x, x.stride(0), x.stride(1), amax, R, C, ROWS=rows, COLS=cols, BLOCK_R=amax_r, BLOCK_C=amax_c,
        ROW_TILES=row_tiles, num_warps=AMAX_WARPS)
    grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
    q_args = (q, q.stride(0), q.stride(1), scale) if q is not None else (amax, 0, 0, amax)
    t_args = (qt, qt.stride(0), qt.stride(1), scale_t) if qt is not None else (amax, 0, 0, amax)
    _quantize_kernel[grid](x, x.stride(0), x.stride(1), amax, *q_args, *t_args, R, C, float(fp8_max), ROWS=rows,
                           COLS=cols, BLOCK_R=block_r, BLOCK_C=block_c, EMULATE=emulate is not None,
                           MANTISSA=mantissa, MIN_EXP=min_exp, num_warps=QUANT_WARPS)


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, rows: bool = True, cols: bool = False):
    """``(q, scale, qt, scale_t)``: the 2-D ``x`` [R, C] quantized to the fp8 ``dtype`` (``float8_e4m3fn``
    or ``float8_e5m2``) per row (``rows``: q [R, C] contiguous, scale [R] fp32, ``x ~ scale[:, None] *
    q``) and per column (``cols``: qt [C, R] contiguous, the quantized x^T, scale_t [C]); None for a
    layout not asked for. Both from one pair of passes over x (:func:`quantize_into`). A transposed
    view (``w.t()``) as x gives the quantized transpose as q. Under the interpreter (no fp8
    conversions) q and qt are float32 holding the fp8 values exactly (:func:`fp8_round`)."""
    check_tensor("x", x, ndim=2)
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be one of {[str(d) for d in FP8_MAX]}, got {dtype}")
    emulate = dtype if interpreting() else None
    R, C = x.shape
    q_dtype = torch.float32 if emulate else dtype
    q, scale = (torch.empty((R, C), dtype=q_dtype, device=x.device),
                torch.empty(R, dtype=torch.float32, device=x.device)) if rows else (None, None)
    qt, scale_t = (torch.empty((C, R), dtype=q_dtype, device=x.device),
                   torch.empty(C, dtype=torch.float32, device=x.device)) if cols else (None, None)
    quantize_into(x, FP8_MAX[dtype], q, scale, qt, scale_t, emulate)
    return q, scale, qt, scale_t
