"""Muon (and NorMuon) in Triton: momentum, batched orthogonalisation and the weight update.

Muon (K. Jordan et al., 2024) updates a weight matrix ``W`` (``m x n``) with the orthogonalised
momentum of its gradient ``G``::

    M <- M + (1 - mu) (G - M)                      (momentum buffer, fp32)
    U  = G + mu (M - G)   (Nesterov)   or   U = M
    O  = polar(U) ~ quintic iteration below
    W <- W (1 - lr wd) - lr * adjust(m, n) * O

``polar`` works on ``X = U`` for a wide or ``X = U^T`` for a tall matrix (``m >= n``: the
``S x L`` work matrix has ``S = min(m, n)`` rows), normalised ``X_0 = X / (|X|_F * f + eps)``, then
for ``k = 0..steps-1`` with coefficients ``(a_k, b_k, c_k)``::

    A = X X^T                 (S x S, symmetric)
    B = b_k A + c_k A A^T     (A A^T = A^2, symmetric)
    X <- a_k X + B X

``coefficients="newton_schulz"``: the quintic Newton-Schulz iteration ``(3.4445, -4.7750, 2.0315)``
every step, ``f = 1`` (``torch.optim.Muon``'s); ``"polar_express"``: the five per-step Polar
Express polynomials of Amsel, Persson, Musco & Gower (arXiv 2505.16932; safety factor 2e-2,
cushion 2, as modded-nanogpt and nanochat use them), ``f = 1.01``; later steps repeat the last one.

Kernels. ``A = alpha X X^T + beta C`` (``_muon_gram_kernel``) computes only the tiles on and below
the diagonal of the tile grid and stores each off-diagonal tile twice (itself and its transpose):
half the products of a general GEMM. It is used twice per step (``X X^T``, then ``b A + c A A^T``
with ``C = A``). ``X <- a X + B X`` (``_muon_update_kernel``) is a batched GEMM with the axpy in
its epilogue. Every kernel takes all the same-shape matrices of a call in one launch (grid axis 1:
the matrix), so a call costs ``4 + 3 * steps`` launches (+1 with NorMuon) per distinct shape.
Products run in the work dtype (bf16 on a GPU: tensor cores) with fp32 accumulation; under the
interpreter, which has no bf16 ``tl.dot``, in fp32. The normalisation ``1 / (|U|_F f + eps)`` is
folded into the first iteration (``A_0 = s^2 U U^T``, ``X_1 = s (a U + B_0 U)``), computed by a
tiny kernel from per-tile partial sums of squares reduced in a fixed order (deterministic).

NorMuon (Li et al., arXiv 2510.05491, in nanochat's factored form): per column ``j`` of ``X`` (the
index along the larger dimension of ``W``; rows of a square ``W``)::

    v_j  = mean_i X_ij^2
    V_j <- V_j + (1 - beta2) (v_j - V_j)           (second moment, fp32, state)
    s_j  = 1 / sqrt(max(V_j, 1e-10))
    X_ij <- X_ij s_j |X|_F / max(|X s|_F, 1e-10)   (per-neuron normalised, Frobenius norm kept)

Device-resident step: the learning rate can be a 0-d fp32 device tensor (multiplied by the float
``lr_scale`` in the kernel) and an int32 ``found_inf`` flag leaves weights, momentum and second
moments untouched: nothing reads the device, so a CUDA graph can capture the whole step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import FLOAT_DTYPES, check_flag, check_lr, check_tensor
from .launch import TL_DTYPE, cached, next_pow2, upload
from .custom_op import compilable, compiled, define, eager, fake, present, split_lr, spread

#: Newton-Schulz quintic of torch.optim.Muon / K. Jordan's Muon, used for every step
NEWTON_SCHULZ_COEFFS = ((3.4445, -4.7750, 2.0315),)
#: Polar Express (arXiv 2505.16932), 5 iterations, safety factor 2e-2, cushion 2
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
#: name -> (per-step coefficients, factor f on the Frobenius norm of the normalisation)
COEFFICIENTS = {"newton_schulz": (NEWTON_SCHULZ_COEFFS, 1.0), "polar_express": (POLAR_EXPRESS_COEFFS, 1.01)}
ADJUST_LR = ("original", "match_rms_adamw", "none")

#: tiles on a GPU: elementwise kernels (momentum, NorMuon statistics, update) ``ew x ew``, the
#: symmetric product ``BS x BS`` stepping ``BK``, the update GEMM ``BM x BN`` stepping ``BK``. Not
#: measured yet.
_GPU_TILES = dict(ew=64, gram=(64, 64), update=(64, 128, 64))
#: the same under the interpreter, where the cost is per program: large (tests/test_muon.py shrinks
#: them to cover several tiles, the mirrored ones included)
_INTERPRET_TILES = dict(ew=128, gram=(128, 128), update=(128, 128, 128))


def coefficient_schedule(coefficients: str, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """``(a_k, b_k, c_k)`` for ``k = 0..steps-1`` and the normalisation factor ``f`` of a named set."""
    if coefficients not in COEFFICIENTS:
        raise ValueError(f"coefficients must be one of {sorted(COEFFICIENTS)}, got {coefficients!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    table, factor = COEFFICIENTS[coefficients]
    return [table[min(k, len(table) - 1)] for k in range(steps)], factor


def lr_adjustment(adjust_lr: str, m: int, n: int) -> float:
    """Factor on the learning rate of an ``m x n`` matrix: ``"original"`` ``sqrt(max(1, m / n))``
    (K. Jordan's Muon), ``"match_rms_adamw"`` ``0.2 sqrt(max(m, n))`` (Moonlight), ``"none"`` 1."""
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "none":
        return 1.0
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


@triton.jit
def _tile_rows_cols(pid, n, BLOCK: tl.constexpr):
    """Rows and columns of tile ``pid`` of a row-major grid of ``BLOCK x BLOCK`` tiles over ``n`` columns."""
    tiles_n = tl.cdiv(n, BLOCK)
    return (pid // tiles_n) * BLOCK + tl.arange(0, BLOCK), (pid % tiles_n) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _tile_offsets(pid, m, n, L, TALL: tl.constexpr, BLOCK: tl.constexpr):
    """The int64 element offsets of this program's ``BLOCK x BLOCK`` tile of the ``m x n`` weight,
    in the weight and in the work matrix (``X = W`` or ``W^T``, row length ``L``), and its mask."""
    rm, rn = _tile_rows_cols(pid, n, BLOCK)
    rm64 = rm.to(tl.int64)[:, None]
    rn64 = rn.to(tl.int64)[None, :]
    w_offs = rm64 * n + rn64
    x_offs = rn64 * L + rm64 if TALL else rm64 * L + rn64
    return w_offs, x_offs, (rm[:, None] < m) & (rn[None, :] < n)


@triton.jit
def _muon_prepare_kernel(
    table_ptr,      # int64 [B, 5]: addresses of weight, gradient, momentum buffer, master (or weight), second moment
    skip_ptr,       # 0-d int32: non-zero leaves the momentum buffers (read when HAS_SKIP)
    x_ptr,          # out: work dtype [B, S, L], U (or U^T for a tall weight)
    partial_ptr,    # out: fp32 [B, tiles], sum of U^2 per tile
    m, n, L,        # weight shape; L = max(m, n)
    momentum,
    G_DTYPE: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,  # False: U = G (column 1 only; orthogonalize())
    NESTEROV: tl.constexpr,
    TALL: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    w_offs, x_offs, mask = _tile_offsets(pid, m, n, L, TALL, BLOCK)
    row = table_ptr + b * 5
    g = tl.load(tl.load(row + 1).to(tl.pointer_type(G_DTYPE)) + w_offs, mask=mask, other=0.0).to(tl.float32)
    u = g
    if HAS_MOMENTUM:
        buf_ptrs = tl.load(row + 2).to(tl.pointer_type(tl.float32)) + w_offs
        buf = tl.load(buf_ptrs, mask=mask, other=0.0)
        buf = buf + (1.0 - momentum) * (g - buf)
        skip = tl.load(skip_ptr) != 0 if HAS_SKIP else False
        if not skip:
            tl.store(buf_ptrs, buf, mask=mask)
        u = g + momentum * (buf - g) if NESTEROV else buf
    tl.store(x_ptr + b * m * n + x_offs, u.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + b * tl.num_programs(0) + pid, tl.sum(tl.sum(u * u, axis=1), axis=0))


@triton.jit
def _muon_scale_kernel(
    partial_ptr,    # fp32 [B, n_partials]: sums of squares
    scale_ptr,      # out: fp32 [B], 1 / (sqrt(sum) * factor + eps)
    n_partials,
    factor,
    eps,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + b * n_partials + offs, mask=offs < n_partials, other=0.0)
    tl.store(scale_ptr + b, 1.0 / (tl.sqrt_rn(tl.sum(acc, axis=0)) * factor + eps))


@triton.jit
def _muon_gram_kernel(
    x_ptr,          # [B, S, K] work dtype, contiguous
    c_ptr,          # [B, S, S] symmetric, added times beta (read when HAS_C)
    out_ptr,        # out: [B, S, S], alpha * s_b^2 * X X^T + beta * C
    scale_ptr,      # fp32 [B]: s_b (read when HAS_SCALE)
    S, K,
    alpha, beta,
    HAS_C: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
):
    """Tile ``t`` of the lower triangle of the tile grid: row ``r``, column ``c <= r`` with
    ``t = r (r + 1) / 2 + c``; the off-diagonal tiles are stored at ``(r, c)`` and, transposed, at
    ``(c, r)``."""
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    r = tl.where((r + 1) * (r + 2) // 2 <= t, r + 1, r)  # the fp32 root can be one off either way
    r = tl.where(r * (r + 1) // 2 > t, r - 1, r)
    c = t - r * (r + 1) // 2
    ri = r * BS + tl.arange(0, BS)
    ci = c * BS + tl.arange(0, BS)
    rk = tl.arange(0, BK)
    xb = x_ptr + b * S * K
    a_ptrs = xb + ri.to(tl.int64)[:, None] * K + rk[None, :]
    b_ptrs = xb + ci.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BS, BS], tl.float32)
    for k in range(0, K, BK):
        kmask = (k + rk)[None, :] < K
        xa = tl.load(a_ptrs, mask=(ri[:, None] < S) & kmask, other=0.0)
        xc = tl.load(b_ptrs, mask=(ci[:, None] < S) & kmask, other=0.0)
        acc = tl.dot(xa, tl.trans(xc), acc)
        a_ptrs += BK
        b_ptrs += BK
    if HAS_SCALE:
        s = tl.load(scale_ptr + b)
        acc = acc * (s * s)
    acc = acc * alpha
    mask = (ri[:, None] < S) & (ci[None, :] < S)
    offs = b * S * S + ri.to(tl.int64)[:, None] * S + ci[None, :]
    if HAS_C:
        acc += beta * tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out, mask=mask)
    if c != r:
        offs_t = b * S * S + ci.to(tl.int64)[None, :] * S + ri[:, None]
        tl.store(out_ptr + offs_t, out, mask=mask)


@triton.jit
def _muon_update_kernel(
    p_ptr,          # [B, S, S] symmetric polynomial B = b A + c A^2, work dtype
    x_ptr,          # [B, S, L] X, work dtype
    out_ptr,        # out: [B, S, L], s_b * (a X + B X)
    scale_ptr,      # fp32 [B]: s_b (read when HAS_SCALE)
    S, L,
    a,
    HAS_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(L, BN)
    rm = (pid // tiles_n) * BM + tl.arange(0, BM)
    rn = (pid % tiles_n) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    pb = p_ptr + b * S * S
    xb = x_ptr + b * S * L
    p_ptrs = pb + rm.to(tl.int64)[:, None] * S + rk[None, :]
    x_ptrs = xb + rk.to(tl.int64)[:, None] * L + rn[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, S, BK):
        kk = k + rk
        pm = tl.load(p_ptrs, mask=(rm[:, None] < S) & (kk[None, :] < S), other=0.0)
        xm = tl.load(x_ptrs, mask=(kk[:, None] < S) & (rn[None, :] < L), other=0.0)
        acc = tl.dot(pm, xm, acc)
        p_ptrs += BK
        x_ptrs += BK * L
    mask = (rm[:, None] < S) & (rn[None, :] < L)
    offs = rm.to(tl.int64)[:, None] * L + rn[None, :]
    acc += a * tl.load(xb + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + b)
    tl.store(out_ptr + b * S * L + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normuon_stats_kernel(
    table_ptr,      # int64 [B, 5] as for _muon_momentum_kernel (column 4: the fp32 second moment, L values)
    skip_ptr,       # 0-d int32: non-zero leaves the second moments (read when HAS_SKIP)
    x_ptr,          # [B, S, L] orthogonalised X, work dtype
    col_ptr,        # out: fp32 [B, L], s_j = 1 / sqrt(max(V_j, 1e-10))
    partial_ptr,    # out: fp32 [B, tiles, 2], sum_j v_j and sum_j v_j s_j^2 over this tile's columns
    S, L,
    beta2,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < L
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    xb = x_ptr + b * S * L
    for i in range(0, S, BLOCK):
        ri = i + rows
        x = tl.load(xb + ri.to(tl.int64)[:, None] * L + cols[None, :], mask=(ri[:, None] < S) & cmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x * x, axis=0)
    v = acc / S
    v_ptrs = tl.load(table_ptr + b * 5 + 4).to(tl.pointer_type(tl.float32)) + cols
    V = tl.load(v_ptrs, mask=cmask, other=0.0)
    V = V + (1.0 - beta2) * (v - V)
    skip = tl.load(skip_ptr) != 0 if HAS_SKIP else False
    if not skip:
        tl.store(v_ptrs, V, mask=cmask)
    s = 1.0 / tl.sqrt_rn(tl.maximum(V, 1e-10))
    tl.store(col_ptr + b * L + cols, s, mask=cmask)
    out = partial_ptr + (b * tl.num_programs(0) + pid) * 2
    tl.store(out, tl.sum(tl.where(cmask, v, 0.0), axis=0))
    tl.store(out + 1, tl.sum(tl.where(cmask, v * s * s, 0.0), axis=0))


@triton.jit
def _muon_apply_kernel(
    table_ptr,      # int64 [B, 5]: addresses of weight, gradient, momentum buffer, master (or weight), second moment
    skip_ptr,       # 0-d int32: non-zero skips the update (read when HAS_SKIP)
    lr_ptr,         # 0-d fp32 learning rate (read when LR_ON_DEVICE)
    x_ptr,          # [B, S, L] orthogonalised update (X = O or O^T), work dtype
    col_ptr,        # fp32 [B, L] NorMuon column scales (read when NORMUON)
    partial_ptr,    # fp32 [B, n_partials, 2] NorMuon sums (read when NORMUON)
    m, n, L, S,
    n_partials,
    lr,             # the learning rate when not LR_ON_DEVICE
    lr_scale,       # multiplies the learning rate (weight decay and update)
    adjust,         # multiplies the update's learning rate only
    weight_decay,
    P_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    NORMUON: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    TALL: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
    PBLOCK: tl.constexpr,
):
    skip = tl.load(skip_ptr) != 0 if HAS_SKIP else False
    if not skip:
        pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        w_offs, x_offs, mask = _tile_offsets(pid, m, n, L, TALL, BLOCK)
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr)
        lr = lr * lr_scale
        u = tl.load(x_ptr + b * m * n + x_offs, mask=mask, other=0.0).to(tl.float32)
        if NORMUON:
            offs = tl.arange(0, PBLOCK)
            acc = tl.zeros([PBLOCK, 2], tl.float32)
            for start in range(0, n_partials, PBLOCK):
                idx = start + offs
                acc += tl.load(partial_ptr + (b * n_partials + idx)[:, None] * 2 + tl.arange(0, 2)[None, :],
                               mask=(idx < n_partials)[:, None], other=0.0)
            sums = tl.sum(acc, axis=0)
            v_sum = tl.sum(tl.where(tl.arange(0, 2) == 0, sums, 0.0), axis=0)
            vs_sum = tl.sum(tl.where(tl.arange(0, 2) == 1, sums, 0.0), axis=0)
            ratio = tl.sqrt_rn(S * v_sum) / tl.maximum(tl.sqrt_rn(S * vs_sum), 1e-10)
            rm, rn = _tile_rows_cols(pid, n, BLOCK)
            j = rm if TALL else rn  # the index along X's columns
            s = tl.load(col_ptr + b * L + j, mask=j < L, other=0.0)
            u = u * (s[:, None] if TALL else s[None, :]) * ratio
        row = table_ptr + b * 5
        p_ptrs = tl.load(row).to(tl.pointer_type(P_DTYPE)) + w_offs
        w_ptrs = tl.load(row + 3).to(tl.pointer_type(tl.float32)) + w_offs if HAS_MASTER else p_ptrs
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        w = w * (1.0 - lr * weight_decay) - (lr * adjust) * u
        if HAS_MASTER:
            tl.store(w_ptrs, w, mask=mask)
        tl.store(p_ptrs, w.to(P_DTYPE), mask=mask)


def muon_work_dtype(work_dtype) -> torch.dtype:
    """The dtype of the iterations: bf16 on a GPU, fp32 under the interpreter (no bf16 ``tl.dot``)."""
    if work_dtype is None:
        return torch.float32 if interpreting() else torch.bfloat16
    if work_dtype not in FLOAT_DTYPES:
        raise TypeError(f"work_dtype must be one of {FLOAT_DTYPES}, got {work_dtype}")
    if work_dtype == torch.bfloat16 and interpreting():
        raise ValueError("work_dtype=bfloat16 needs a GPU: Triton's interpreter has no bfloat16 tl.dot")
    return work_dtype


def _tiles() -> dict:
    return _INTERPRET_TILES if interpreting() else _GPU_TILES


def _prepare(table, found_inf, shape, batch, g_dtype, work_dtype, momentum, nesterov, has_momentum, device):
    """``U`` of every matrix in the ``[batch, S, L]`` work layout, and its per-tile sums of squares."""
    m, n = shape
    tall = m >= n
    x = torch.empty((batch, min(m, n), max(m, n)), dtype=work_dtype, device=device)
    ew = _tiles()["ew"]
    tiles = triton.cdiv(m, ew) * triton.cdiv(n, ew)
    partials = torch.empty((batch, tiles), dtype=torch.float32, device=device)
    has_skip = found_inf is not None
    _muon_prepare_kernel[(tiles, batch)](table, found_inf if has_skip else table, x, partials, m, n, max(m, n),
                                         float(momentum), G_DTYPE=TL_DTYPE[g_dtype], HAS_MOMENTUM=has_momentum,
                                         NESTEROV=bool(nesterov), TALL=tall, HAS_SKIP=has_skip, BLOCK=ew,
                                         num_warps=4)
    return x, partials


def _polar(x: torch.Tensor, partials: torch.Tensor, schedule, factor: float, eps: float) -> torch.Tensor:
    """The iterations on ``x`` (``[B, S, L]``, unnormalised ``U``; ``partials``: its sums of squares).
    Returns the buffer holding the result (``x`` or a second one)."""
    batch, S, L = x.shape
    device = x.device
    scale = torch.empty(batch, dtype=torch.float32, device=device)
    n_partials = partials.shape[1]
    _muon_scale_kernel[(batch,)](partials, scale, n_partials, float(factor), float(eps),
                                 BLOCK=min(next_pow2(n_partials), 1024), num_warps=4)
    gram_bs, gram_bk = _tiles()["gram"]
    bm, bn, bk = _tiles()["update"]
    n_tri = triton.cdiv(S, gram_bs) * (triton.cdiv(S, gram_bs) + 1) // 2
    gram = torch.empty((batch, S, S), dtype=x.dtype, device=device)
    poly = torch.empty_like(gram)
    y = torch.empty_like(x)
    for k, (a, b, c) in enumerate(schedule):
        first = k == 0
        _muon_gram_kernel[(n_tri, batch)](x, x, gram, scale, S, L, 1.0, 0.0, HAS_C=False, HAS_SCALE=first,
                                          BS=gram_bs, BK=gram_bk, num_warps=4)
        _muon_gram_kernel[(n_tri, batch)](gram, gram, poly, scale, S, S, float(c), float(b), HAS_C=True,
                                          HAS_SCALE=False, BS=gram_bs, BK=gram_bk, num_warps=4)
        _muon_update_kernel[(triton.cdiv(S, bm) * triton.cdiv(L, bn), batch)](
            poly, x, y, scale, S, L, float(a), HAS_SCALE=first, BM=bm, BN=bn, BK=bk, num_warps=4)
        x, y = y, x
    return x


def _matrix_table(columns, shape, device) -> torch.Tensor:
    """int64 ``[B, 5]`` table of per-matrix addresses: ``columns`` are 5 lists (one entry per tensor)
    of ``(tensor, elements per matrix)`` or None (column filled with column 0's address)."""
    m, n = shape
    rows = []
    first = columns[0]
    for i, (p, per) in enumerate(first):
        count = p.numel() // per if per else 0
        for j in range(count):
            row = []
            for col in columns:
                t, t_per = (col[i] if col is not None else first[i])
                row.append(t.data_ptr() + j * t_per * t.element_size())
            rows.append(row)
    return upload(torch.tensor(rows, dtype=torch.int64).view(-1, 5), device)


@compilable
def orthogonalize(x: torch.Tensor, *, coefficients: str = "polar_express", steps: int = 5, eps: float = 1e-7,
                  work_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The approximate orthogonal polar factor of each matrix of ``x`` (``[m, n]`` or ``[..., m, n]``,
    contiguous, fp32/fp16/bf16), by the iteration of the module docstring (``steps`` of the named
    ``coefficients``). Returns a tensor of ``x``'s shape in ``work_dtype`` (default bf16 on a GPU,
    fp32 under the interpreter); for ``m >= n`` it is a transposed view of the ``[..., n, m]`` work
    buffer."""
    check_tensor("x", x, min_ndim=2)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    schedule, factor = coefficient_schedule(coefficients, steps)
    work = muon_work_dtype(work_dtype)
    m, n = x.shape[-2:]
    batch = x.numel() // (m * n) if m * n else 0
    if batch == 0:
        return torch.empty(x.shape, dtype=work, device=x.device)
    table = _matrix_table([[(x, m * n)]] + [None] * 4, (m, n), x.device)
    u, partials = _prepare(table, None, (m, n), batch, x.dtype, work, 0.0, False, False, x.device)
    out = _polar(u, partials, schedule, factor, eps)
    out = out.view(*x.shape[:-2], min(m, n), max(m, n))
    return out.transpose(-1, -2) if m >= n else out


def _check_list(name: str, tensors, params, dtypes, shape_of) -> None:
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors but params has {len(params)}")
    for i, (t, p) in enumerate(zip(tensors, params)):
        if t is None:
            continue
        check_tensor(f"{name}[{i}]", t, dtypes=dtypes)
        if t.device != p.device:
            raise ValueError(f"{name}[{i}] is on {t.device} but params[{i}] is on {p.device}")
        if tuple(t.shape) != shape_of(p):
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, expected {shape_of(p)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")


@compilable
def muon_step_(params, grads, momentum_bufs, masters=None, second_moments=None, *, lr, lr_scale: float = 1.0,
               momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
               coefficients: str = "polar_express", steps: int = 5, eps: float = 1e-7, adjust_lr: str = "original",
               beta2: float = 0.95, found_inf: torch.Tensor | None = None,
               work_dtype: torch.dtype | None = None) -> None:
    """One Muon (or, with ``second_moments``, NorMuon) step, in place, over lists of tensors (the math
    in the module docstring).

    ``params``: contiguous fp32/fp16/bf16 tensors of at least 2 dims; the last two are a matrix
    ``m x n``, leading dims index independent matrices (e.g. stacked experts). ``grads``: one per
    parameter, its shape. ``momentum_bufs``: fp32, the parameter's shape. ``masters``: None, or per
    parameter None or an fp32 master copy of a bf16/fp16 parameter (updated, then rounded into
    the parameter). ``second_moments``: None (Muon) or per parameter an fp32 tensor
    ``[..., max(m, n)]`` (NorMuon's per-neuron second moment).
    ``lr``: a float or a one-element fp32 device tensor (read by the kernels), times ``lr_scale``;
    the update of a matrix is further scaled by :func:`lr_adjustment` (``adjust_lr``); weight decay
    ``w *= 1 - lr * lr_scale * weight_decay``. ``found_inf``: None or a one-element int32 device
    tensor; non-zero leaves every tensor untouched. ``work_dtype``: dtype of the iterations.

    Launches: per distinct (matrix shape, dtypes, master or not) bucket, ``4 + 3 * steps`` (+1 for
    NorMuon), each over all the bucket's matrices. No host synchronisation.
    """
    params = list(params)
    if not params:
        return
    device = params[0].device
    for i, p in enumerate(params):
        check_tensor(f"params[{i}]", p, min_ndim=2)
        if not p.is_contiguous():
            raise ValueError(f"params[{i}] must be contiguous")
        if p.device != device:
            raise ValueError(f"params[{i}] is on {p.device} but params[0] is on {device}: one device per call")
    same = lambda p: tuple(p.shape)  # noqa: E731
    _check_list("grads", grads, params, FLOAT_DTYPES, same)
    _check_list("momentum_bufs", momentum_bufs, params, (torch.float32,), same)
    if masters is not None:
        _check_list("masters", masters, params, (torch.float32,), same)
        for i, (p, w) in enumerate(zip(params, masters)):
            if w is not None and p.dtype == torch.float32:
                raise TypeError(f"masters[{i}] must be None for an fp32 parameter")
    if second_moments is not None:
        _check_list("second_moments", second_moments, params, (torch.float32,),
                    lambda p: (*p.shape[:-2], max(p.shape[-2:])))
    for i, t in enumerate(momentum_bufs):
        if t is None:
            raise TypeError(f"momentum_bufs[{i}] must be a tensor")
    lr_on_device = check_lr(lr, device)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    check_flag("found_inf", found_inf, device)
    schedule, factor = coefficient_schedule(coefficients, steps)
    work = muon_work_dtype(work_dtype)
    normuon = second_moments is not None
    has_skip = found_inf is not None

    buckets: dict = {}
    for i, p in enumerate(params):
        w = masters[i] if masters is not None else None
        key = (tuple(p.shape[-2:]), p.dtype, grads[i].dtype, w is not None)
        buckets.setdefault(key, []).append(i)
    for (shape, p_dtype, g_dtype, has_master), idx in buckets.items():
        m, n = shape
        per, big = m * n, max(m, n)
        batch = sum(params[i].numel() // per for i in idx) if per else 0
        if batch == 0:
            continue
        columns = [[(params[i], per) for i in idx], [(grads[i], per) for i in idx],
                   [(momentum_bufs[i], per) for i in idx],
                   [(masters[i], per) for i in idx] if has_master else None,
                   [(second_moments[i], big) for i in idx] if normuon else None]
        addrs = tuple(t.data_ptr() for col in columns if col is not None for t, _ in col)
        (table,) = cached(("muon", device, shape, tuple(params[i].numel() for i in idx), normuon, has_master,
                            addrs), lambda columns=columns, shape=shape: (_matrix_table(columns, shape, device),))
        u, partials = _prepare(table, found_inf, shape, batch, g_dtype, work, momentum, nesterov, True, device)
        x = _polar(u, partials, schedule, factor, eps)
        S = min(m, n)
        ew = _tiles()["ew"]
        n_stats = triton.cdiv(big, ew)
        if normuon:
            cols = torch.empty((batch, big), dtype=torch.float32, device=device)
            stats = torch.empty((batch, n_stats, 2), dtype=torch.float32, device=device)
            _normuon_stats_kernel[(n_stats, batch)](table, found_inf if has_skip else table, x, cols, stats, S, big,
                                                    float(beta2), HAS_SKIP=has_skip, BLOCK=ew, num_warps=4)
        else:
            cols = stats = partials
        tiles = triton.cdiv(m, ew) * triton.cdiv(n, ew)
        _muon_apply_kernel[(tiles, batch)](
            table, found_inf if has_skip else table, lr if lr_on_device else table, x, cols, stats, m, n, big, S,
            n_stats, 0.0 if lr_on_device else float(lr), float(lr_scale), lr_adjustment(adjust_lr, m, n),
            float(weight_decay), P_DTYPE=TL_DTYPE[p_dtype], HAS_MASTER=has_master, NORMUON=normuon,
            LR_ON_DEVICE=lr_on_device, TALL=m >= n, HAS_SKIP=has_skip, BLOCK=ew,
            PBLOCK=min(next_pow2(n_stats), 1024), num_warps=4)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::muon_step", mutates_args=("params", "momentum_bufs", "masters", "second_moments"))
def muon_step_op(params: list[Tensor], grads: list[Tensor], momentum_bufs: list[Tensor], masters: list[Tensor],
                 has_master: list[bool], second_moments: list[Tensor], normuon: bool, lr: float,
                 lr_tensor: Optional[Tensor], lr_scale: float, momentum: float, nesterov: bool, weight_decay: float,
                 coefficients: str, steps: int, eps: float, adjust_lr: str, beta2: float, found_inf: Optional[Tensor],
                 work_dtype: Optional[torch.dtype]) -> None:
    """:func:`kernels.muon.muon_step_` (``second_moments`` used when ``normuon``; ``lr_tensor``, when
    given, is the learning rate)."""
    eager(muon_step_)(params, grads, momentum_bufs, spread(masters, has_master),
                      second_moments if normuon else None, lr=lr if lr_tensor is None else lr_tensor,
                      lr_scale=lr_scale, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                      coefficients=coefficients, steps=steps, eps=eps, adjust_lr=adjust_lr, beta2=beta2,
                      found_inf=found_inf, work_dtype=work_dtype)


@fake(muon_step_op)
def _(*args):
    return None


@compiled("muon_step_")
def _compiled_muon_step_(params, grads, momentum_bufs, masters=None, second_moments=None, *, lr, lr_scale: float = 1.0,
                         momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
                         coefficients: str = "polar_express", steps: int = 5, eps: float = 1e-7, adjust_lr: str = "original",
                         beta2: float = 0.95, found_inf: Tensor | None = None, work_dtype: torch.dtype | None = None) -> None:
    params = list(params)
    given_masters, has_master = present(masters, len(params))
    muon_step_op(params, list(grads), list(momentum_bufs), given_masters, has_master, list(second_moments or []),
                 second_moments is not None, *split_lr(lr), float(lr_scale), float(momentum), bool(nesterov),
                 float(weight_decay), coefficients, int(steps), float(eps), adjust_lr, float(beta2), found_inf,
                 work_dtype)


@define("tritonllm::orthogonalize_fwd", mutates_args=())
def orthogonalize_fwd_op(x: Tensor, coefficients: str, steps: int, eps: float,
                         work_dtype: Optional[torch.dtype]) -> Tensor:
    """:func:`kernels.muon.orthogonalize` (no gradient)."""
    return eager(orthogonalize)(x, coefficients=coefficients, steps=steps, eps=eps, work_dtype=work_dtype)


@fake(orthogonalize_fwd_op)
def _(x, coefficients, steps, eps, work_dtype):
    work = muon_work_dtype(work_dtype)
    m, n = x.shape[-2:]
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=work)
    out = x.new_empty((*x.shape[:-2], min(m, n), max(m, n)), dtype=work)
    return out.transpose(-1, -2) if m >= n else out


@compiled("orthogonalize")
def _compiled_orthogonalize(x: Tensor, *, coefficients: str = "polar_express", steps: int = 5, eps: float = 1e-7,
                            work_dtype: torch.dtype | None = None) -> Tensor:
    return orthogonalize_fwd_op(x, coefficients, int(steps), float(eps), work_dtype)
