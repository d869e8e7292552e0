"""Fused flash attention: causal (bottom-right), native GQA/MQA, sliding window, KV-cache decode.

Shapes: ``q`` is ``[B, T, Hq, D]``, ``k`` and ``v`` are ``[B, S, Hkv, D]`` with ``Hq % Hkv == 0``;
query head ``h`` reads key/value head ``h // (Hq / Hkv)``. Inputs may be strided views (e.g. slices
of a packed qkv projection); only the last dimension must be contiguous. Nothing is transposed.

Forward, per batch, query head h, query row i, with ``s = softmax_scale`` (default ``D**-0.5``)::

    visible(i, j) = j < S
                    and (not causal or j <= i + S - T)            # bottom-right aligned causal mask
                    and (window is None or j > i + S - T - window)  # the last `window` keys at most
    x_ij   = s * q_i . k_j                     for visible pairs, -inf otherwise
    lse_i  = log sum_j exp(x_ij)               (fp32 [B, Hq, T], -inf for a row that sees no key)
    o_i    = sum_j exp(x_ij - lse_i) v_j       (0 for a row that sees no key)

computed FlashAttention-2 style: one program per (query block, batch x query head) streams the
key/value tiles with an online softmax in base 2 (scores scaled by ``s * log2(e)`` inside the
exponent's FMA, ``exp2(x * s log2(e) - m)``, so the resident q tile stays an unscaled
shared-memory operand of the tensor-core product), fp32 accumulators. Key tiles wholly
outside a query block's causal/window range are skipped (the loop bounds are computed per query
block), tiles wholly inside are processed without masks: either in three loops (masked head,
mask-free middle, masked tail) or in one loop whose edge tiles take a masking branch (``ONE_LOOP``).
On sm90+ GPUs (and under the interpreter) 16-bit inputs with 16-byte aligned strides stream their
tiles through tensor descriptors (TMA, knob ``TMA``); other inputs through masked pointer loads.
Decode (``T <= 16``, or too few query blocks to fill the GPU) uses a split-KV (flash-decoding)
kernel instead: programs over (KV split, block of the group's query rows, batch x KV head) put
all ``Hq / Hkv`` query heads of a KV head in the M dimension of the tile, so each K/V tile is read
once per group, and write partial ``(o, lse)`` that a combine kernel merges.

Backward, with ``P_ij = exp(x_ij - lse_i)`` recomputed from the saved lse and ``dO`` the
output gradient::

    delta_i = sum_d dO_id O_id                                   (preprocess kernel)
    dV_j    = sum_{h in group(j), i} P_ij dO_i
    dS_ij   = P_ij (dO_i . v_j - delta_i)
    dK_j    = s * sum_{h in group(j), i} dS_ij q_i
    dQ_i    = s * sum_j dS_ij k_j

The backward has two variants. The default, ``deterministic=True``, is reproducible and, measured
on an H100 with Triton 3.6, the faster: the dK/dV kernel gives each program one key block of one KV
head; it loops over every query head of the group and the query blocks that see the key block,
accumulating dK and dV in registers; the dQ kernel gives each program one query block and loops over
key blocks. Seven tile products per (query, key) tile pair, no atomics. ``deterministic=False``
runs the fused kernel of FlashAttention-2: the same dK/dV kernel also adds its share of dQ (``dS k``,
without the scale) into an fp32 ``[B, Hq, T, D]`` buffer with atomic adds, and a finalize kernel
scales it into dQ: five products, but the order in which the atomics land varies, so dQ may differ
between runs in its last bits, and Triton's element-wise fp32 atomics cost more than the two
products they save (a TMA reduce-add, tried, cost more still). The preprocess
kernel computes delta and the base-2 lse (and zeroes the fused variant's dQ accumulator). All recompute
``P = exp2(s log2(e) q.k - lse log2(e))`` with one FMA per score and leave the resident tile
unscaled: pre-scaling it, as the forward does with q,
turns it from a shared-memory operand of the tensor-core product into a register one (+32
registers per thread at D128, enough to spill in dK/dV). With ``T == S`` the gradients are written
as head slices of one ``[B, T, Hq + 2 Hkv, D]`` buffer, the layout of a packed qkv projection's
gradient. Reference: Dao,
"FlashAttention-2" (2023); Triton's fused-attention tutorial.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._common import (SMEM_PER_BLOCK, Launch, Plans, autotune, check_dot_dtype, check_same_device, check_same_dtype, check_tensor,
                      compilable, interpreting, needs_grad, next_pow2, num_sms, tma_scratch)

#: head dimensions the kernels support (96 is padded to 128 inside the kernel with masks).
HEAD_DIMS = (32, 64, 96, 128, 256)

_LOG2E = 1.4426950408889634
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
_NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
_POS_INF: tl.constexpr = tl.constexpr(float("inf"))

# Split-KV (decode) path, knobs for the lead to tune on the GPU:
_SPLIT_MAX_T = 16          # always use the split-KV kernel for T <= this
_SPLIT_WAVES = 4           # aim for this many programs per SM over the splits
_SPLIT_MIN_KEYS = 256      # fewest keys one split should read
_SPLIT_MAX_ROWS = 64       # largest M tile of (query head, query row) pairs in the split kernel
_COMBINE_ROWS = 16         # (b, h, t) rows per program of the split-combine kernel
_INTERP_COMBINE_ROWS = 64  # the same under the interpreter (fewer programs)
_PREPROCESS_BLOCK_M = 64   # rows per program of the delta = rowsum(dO * O) kernel
#: bytes of shared memory a config may plan for: the estimate counts operand tiles only, so 27 KiB stay
#: for layout conversions and barriers
_SMEM_BUDGET = SMEM_PER_BLOCK - 27 * 1024
_TUNE_MIN_PAIRS = 1 << 20  # autotune prefill/backward only from next_pow2(T) * next_pow2(S) >= this

# Prefill/backward knobs, timed side by side by scripts/tune_attention.py on the GPU (not yet measured):
#: per kernel: stream the K/V tiles (forward, dQ) or the Q/dO tiles and lse/delta rows (dK/dV) through
#: tensor descriptors (TMA) where the device (sm90+), the dtype (16-bit) and the strides (16-byte
#: aligned) allow
TMA = {"fwd": True, "dkdv": True, "dq": True}
#: per kernel and mask kind ("causal": every call without a window): one pipelined loop whose edge
#: tiles take a masking branch (True) instead of three loops with a pipeline prologue each (False);
#: short loops (sliding window: ~9 tiles) should gain. One loop also needs fewer registers (Triton 3.6,
#: sm90, first configs, TMA, D128: forward 232 -> 190, dQ 192 -> 179, dK/dV spills 336 -> 96 bytes)
ONE_LOOP = {"fwd": {"causal": True, "window": True},
            "dkdv": {"causal": True, "window": True},
            "dq": {"causal": True, "window": True}}
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner tries; the first that fits is the pinned
#: config (TRITONLLM_NO_AUTOTUNE=1), the last the fallback of fp32 and small problems.
#: Forward: q tile resident, k/v tiles pipelined (Hopper: M 64 per warpgroup, so BLOCK_M 128 = 8 warps).
#: first entry = the config used without autotuning. 64x64 w4 s3 was the fastest forward at every
#: tuned shape on an H200 (scripts/tune_attention.py: 1.24x the 128x128 w8 s2 tile at B8 Hq32/Hkv8 T4096 D128).
FWD_CONFIGS = [(64, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 32, 4, 2)]
#: dK/dV: k/v tiles (BLOCK_N keys) resident, q/dO tiles (BLOCK_M queries) pipelined. Triton 3.6 sm90
#: compile (TMA, one loop), registers / spill bytes per thread at D128 and D64: 32x128 w8 s2 255/0,
#: 131/0; 64x128 w8 s2 (FlashAttention-2's tile) 255/136, 216/0 (the dK, dV accumulators alone take
#: 128 registers at D128); Triton's tutorial tile 32x128 w4 s5 spills at both (768, 136): left out.
#: 64x128 w8 s3 first: 1.37x / 1.29x the 32x128 w8 s2 tile at B8 Hq32/Hkv8 T4096 D128 / B16 Hq12 T1024 D64
#: on an H100 (scripts/tune_attention.py), spills and all.
DKDV_CONFIGS = [(64, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3), (16, 64, 4, 2)]
#: dQ: q/dO tiles resident, k/v tiles pipelined (128x32 4 warps 5 stages: Triton's tutorial; spills
#: 32 bytes at D128)
#: 128x64 w8 s3 first: 1.16x the 128x64 w8 s2 tile at B8 Hq32/Hkv8 T4096 D128 on an H200 (tune_attention.py)
DQ_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2)]


# ----------------------------------------------------------------------------- shared device code
# Masks are per-row intervals: query i sees keys [first_i, end_i) (computed once per program), so
# a masked tile costs two compares. Helpers are called per program or per loop segment, never per
# tile (each jit-helper call re-patches triton.language under the interpreter, about 3 ms).

@triton.jit
def _keys_seen(q_pos, key_end, shift, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Keys [first, end) seen by queries at ``q_pos``: causal bottom-right (j <= i + shift with
    shift = S - T), window (j > i + shift - window), below ``key_end``. May be empty (end <= first)."""
    first = tl.zeros_like(q_pos)
    end = tl.zeros_like(q_pos) + key_end
    if CAUSAL:
        end = tl.minimum(end, q_pos + shift + 1)
    if HAS_WINDOW:
        first = tl.maximum(first, q_pos + shift - window + 1)
    return first, end


@triton.jit
def _queries_seeing(k_pos, T, shift, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Queries [first, end) that see the keys at ``k_pos``: the inverse of :func:`_keys_seen`."""
    first = tl.zeros_like(k_pos)
    end = tl.zeros_like(k_pos) + T
    if CAUSAL:
        first = tl.maximum(first, k_pos - shift)
    if HAS_WINDOW:
        end = tl.minimum(end, k_pos - shift + window)
    return first, end


@triton.jit
def _in_document(first, end, DOCS_row, pos):
    """[first, end) cut to the document of each position ``pos``: ``DOCS_row`` points to one batch
    row's ``[T, 2]`` int32 bounds (the document's first position, one past its last). Queries and keys
    share positions (T == S), so the same bounds serve both sides."""
    pos64 = pos.to(tl.int64) * 2
    return tl.maximum(first, tl.load(DOCS_row + pos64)), tl.minimum(end, tl.load(DOCS_row + pos64 + 1))


@triton.jit
def _segments(first, end, BLOCK: tl.constexpr):
    """Tile starts of the loop over the other side, from per-row intervals [first, end):
    ``lo <= full_lo <= full_hi <= hi``. Tiles in [lo, full_lo) and [full_hi, hi) need the mask,
    tiles in [full_lo, full_hi) are visible to every row (no mask), tiles outside are skipped.
    Starts are multiples of BLOCK; only non-negative numbers are divided."""
    lo = tl.min(first, 0) // BLOCK * BLOCK
    hi = tl.maximum(tl.max(end, 0), lo)
    full_lo = tl.minimum((tl.max(first, 0) + BLOCK - 1) // BLOCK * BLOCK, hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(tl.min(end, 0), 0) // BLOCK * BLOCK, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs, lo, hi, full_lo,
               full_hi, offs_n, offs_d, d_ok,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax (base 2: scores times qk_scale = s log2(e)) over key tiles lo, lo + BLOCK_N,
    ... < hi. MASK: 0 none, 1 every tile, 2 the tiles outside [full_lo, full_hi) (a branch in the loop); masks apply
    [first, end). K_src, V_src: tensor descriptors (USE_TMA, rows past S read as 0) or base pointers."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k = K_src.load([start_n, 0])
        else:
            kv_mask = d_ok[None, :]
            if MASK != 0:
                kv_mask = kv_mask & (cols < hi)[:, None]  # hi <= every key_end
            kv_rows = cols.to(tl.int64)[:, None]
            k = tl.load(K_src + kv_rows * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK == 1:
            qk = tl.where((cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None]), qk, _NEG_INF)
        elif MASK == 2:
            if (start_n < full_lo) | (start_n >= full_hi):
                qk = tl.where((cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None]), qk, _NEG_INF)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = V_src.load([start_n, 0])
        else:
            v = tl.load(V_src + kv_rows * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend(q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs, offs_n, offs_d, d_ok,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            ONE_LOOP: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(o, lse)`` of BLOCK_M query rows (``qk_scale = s * log2(e)``) over their key intervals
    [first, end): masked edge tiles, mask-free middle; a row with no key gives o = 0, lse = -inf
    (natural log)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # finite start: a row whose first tiles are all masked gets p = exp2(-inf) = 0 and alpha = 1, no NaN
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    lo, full_lo, full_hi, hi = _segments(first, end, BLOCK_N)
    if ONE_LOOP:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs,
                                   lo, hi, full_lo, full_hi, offs_n, offs_d, d_ok, BLOCK_N, 2, USE_TMA,
                                   DOT_PRECISION)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs,
                                   lo, full_lo, full_lo, full_hi, offs_n, offs_d, d_ok, BLOCK_N, 1, USE_TMA,
                                   DOT_PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs,
                                   full_lo, full_hi, full_lo, full_hi, offs_n, offs_d, d_ok, BLOCK_N, 0, USE_TMA,
                                   DOT_PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs,
                                   full_hi, hi, full_lo, full_hi, offs_n, offs_d, d_ok, BLOCK_N, 1, USE_TMA,
                                   DOT_PRECISION)
    return _normalize(acc, l_i, m_i)


@triton.jit
def _normalize(acc, l_i, m_i):
    """(o, natural-log lse) from an online-softmax state in base 2; l_i = 0 gives o = 0, lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, _NEG_INF, (m_i + tl.math.log2(l_safe)) * _LN2)
    return out, lse


# ----------------------------------------------------------------------------- forward kernels

@triton.jit
def _flash_attention_fwd_kernel(
    Q, K, V,                    # q [B, T, Hq, D], k and v [B, S, Hkv, D]: any strides, last dim contiguous
    O,                          # out [B, T, Hq, D], contiguous
    LSE,                        # out [B, Hq, T] fp32, natural-log log-sum-exp of each query row
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    T, S, HQ, GROUP,            # lengths, query heads, query heads per KV head
    shift, window, qk_scale,    # S - T; window (unused without HAS_WINDOW); softmax_scale * log2(e)
    T_BUCKET, S_BUCKET,         # next_pow2(T), next_pow2(S): autotune keys only
    DOCS,                       # with HAS_DOCS: [B, T, 2] int32 document bounds of each position (T == S)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr,  # see the TMA and ONE_LOOP knobs
    HAS_DOCS: tl.constexpr,     # packed documents: a position sees only its own document's positions
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # last query blocks first: with causal they see the most keys
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]

    q_rows = offs_m.to(tl.int64)[:, None]
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_rows * stride_qt + offs_d[None, :], mask=io_mask, other=0.0)
    K_src = K + b * stride_kb + hk * stride_kh
    V_src = V + b * stride_vb + hk * stride_vh
    if USE_TMA:
        K_src = tl.make_tensor_descriptor(K_src, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        V_src = tl.make_tensor_descriptor(V_src, shape=[S, HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    # rows past T take the intervals of row T - 1: they are never stored and must not widen the loop
    first, end = _keys_seen(tl.minimum(offs_m, T - 1), S, shift, window, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        first, end = _in_document(first, end, DOCS + b * T * 2, tl.minimum(offs_m, T - 1))
    out, lse = _attend(q, qk_scale, first, end, K_src, V_src, stride_ks, stride_vs, offs_n, offs_d, d_ok,
                       BLOCK_M, BLOCK_N, BLOCK_D, ONE_LOOP, USE_TMA, DOT_PRECISION)
    o_rows = ((b * T + offs_m) * HQ + h)[:, None]
    tl.store(O + o_rows * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty), mask=io_mask)
    tl.store(LSE + (b * HQ + h) * T + offs_m, lse, mask=row_ok)


@triton.jit
def _flash_attention_split_fwd_kernel(
    Q, K, V,                    # q [B, T, Hq, D], k and v [B, S, Hkv, D]: any strides, last dim contiguous
    O_part,                     # out [splits, B, Hq, T, D] fp32: each split's normalized partial output
    LSE_part,                   # out [splits, B, Hq, T] fp32: each split's log-sum-exp (-inf if it saw no key)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    T, S, HQ, HKV, GROUP,       # lengths, query heads, KV heads, query heads per KV head
    n_rows,                     # B * Hq * T: rows of one split in O_part / LSE_part
    shift, window, qk_scale,    # S - T; window (unused without HAS_WINDOW); softmax_scale * log2(e)
    key_lo, split_size,         # split s reads keys [key_lo + s * split_size, min(S, ... + split_size))
    S_BUCKET,                   # next_pow2(S): autotune key only
    KV_LEN,                     # with LEN_IN_MEMORY: pointer to the number of valid keys (0-d int32/int64)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LEN_IN_MEMORY: tl.constexpr,  # only keys [0, min(*KV_LEN, S)) are valid; shift and key_lo follow from it
):
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    # M rows r = g * T + t: query head hk * GROUP + g at position t, so one K/V tile serves the group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows % T
    h = hk * GROUP + rows // T
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    io_mask = (rows < GROUP * T)[:, None] & d_ok[None, :]

    q_rows = (h * stride_qh + t.to(tl.int64) * stride_qt)[:, None]
    q = tl.load(Q + b * stride_qb + q_rows + offs_d[None, :], mask=io_mask, other=0.0)
    n_keys = S
    if LEN_IN_MEMORY:  # the grid covers the cache (S keys); splits past the valid length see no key
        n_keys = tl.minimum(tl.load(KV_LEN).to(tl.int32), S)
        shift = n_keys - T
        key_lo = tl.maximum(shift - window + 1, 0) if HAS_WINDOW else 0
    n_lo = key_lo + pid_s * split_size
    first, end = _keys_seen(t, tl.minimum(n_lo + split_size, n_keys), shift, window, CAUSAL, HAS_WINDOW)
    out, lse = _attend(q, qk_scale, tl.maximum(first, n_lo), end, K + b * stride_kb + hk * stride_kh,
                       V + b * stride_vb + hk * stride_vh, stride_ks, stride_vs, offs_n, offs_d, d_ok,
                       BLOCK_M, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION)
    part_rows = pid_s.to(tl.int64) * n_rows + (b * HQ + h) * T + t
    tl.store(O_part + part_rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
    tl.store(LSE_part + part_rows, lse, mask=rows < GROUP * T)


@triton.jit
def _flash_attention_combine_kernel(
    O_part,                     # [splits, B, Hq, T, D] fp32 partial outputs
    LSE_part,                   # [splits, B, Hq, T] fp32 partial log-sum-exps
    O,                          # out [B, T, Hq, D], contiguous
    LSE,                        # out [B, Hq, T] fp32
    n_rows, T, HQ, num_splits,  # B * Hq * T; lengths; number of splits
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """BLOCK_R rows (b, h, t) per program: o = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s),
    as an online softmax over the splits in base 2."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b * Hq + h) * T + t
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)  # finite: an empty split (lse -inf) gets weight 0
    for s in range(0, num_splits):
        part_rows = s * n_rows + rows
        lse_s = tl.load(LSE_part + part_rows, mask=row_ok, other=_NEG_INF) * 1.4426950408889634
        o_s = tl.load(O_part + part_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask, other=0.0)
        m_new = tl.maximum(m_i, lse_s)
        alpha = tl.math.exp2(m_i - m_new)
        w = tl.math.exp2(lse_s - m_new)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_s
        m_i = m_new
    out, lse = _normalize(acc, l_i, m_i)
    bh = rows // T
    o_rows = ((bh // HQ * T + rows % T) * HQ + bh % HQ)[:, None]
    tl.store(O + o_rows * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty), mask=io_mask)
    tl.store(LSE + rows, lse, mask=row_ok)


# ----------------------------------------------------------------------------- backward kernels

@triton.jit
def _row_block(T, HQ, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """(b, h, rows, d, row mask, tile mask) of a program over grid (row blocks of T, B * HQ)."""
    pid_bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    return ((pid_bh // HQ).to(tl.int64), (pid_bh % HQ).to(tl.int64), offs_m, offs_d, row_ok,
            row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _flash_attention_bwd_preprocess_kernel(
    O,                          # [B, T, Hq, D] forward output, contiguous
    DO,                         # [B, T, Hq, D] output gradient: any strides, last dim contiguous
    LSE,                        # [B, Hq, T] fp32 forward log-sum-exp (natural log)
    DELTA,                      # out [B, Hq, T(pitch)] fp32: rowsum(dO * O)
    LSE2,                       # out [B, Hq, T(pitch)] fp32: lse * log2(e), +inf for rows that saw no key
    DQ_ACC,                     # out with ZERO_DQ: [B, Hq, T, D] fp32 set to 0 (the fused backward's dQ accumulator)
    stride_dob, stride_dot, stride_doh,
    T, HQ, stat_pitch,          # stat_pitch: row pitch of DELTA and LSE2 (T rounded up to 4)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    b, h, offs_m, offs_d, row_ok, io_mask = _row_block(T, HQ, HEAD_DIM, BLOCK_D, BLOCK_M)
    o_rows = ((b * T + offs_m) * HQ + h)[:, None]
    o = tl.load(O + o_rows * HEAD_DIM + offs_d[None, :], mask=io_mask, other=0.0)
    do_rows = offs_m.to(tl.int64)[:, None] * stride_dot
    do = tl.load(DO + b * stride_dob + h * stride_doh + do_rows + offs_d[None, :], mask=io_mask, other=0.0)
    stat = (b * HQ + h) * stat_pitch + offs_m
    tl.store(DELTA + stat, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    # +inf makes the recomputed probabilities of an empty row exp2(s - inf) = 0
    lse = tl.load(LSE + (b * HQ + h) * T + offs_m, mask=row_ok, other=0.0)
    tl.store(LSE2 + stat, tl.where(lse == _NEG_INF, _POS_INF, lse * 1.4426950408889634), mask=row_ok)
    if ZERO_DQ:
        acc_rows = ((b * HQ + h) * T + offs_m)[:, None]
        tl.store(DQ_ACC + acc_rows * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=io_mask)


@triton.jit
def _flash_attention_bwd_dq_finalize_kernel(
    DQ_ACC,                     # [B, Hq, T, D] fp32: dQ / s from the fused backward's atomic adds
    DQ,                         # out [B, T, Hq, D], strides stride_dq* (e.g. a slice of a packed gradient)
    stride_dqb, stride_dqt, stride_dqh,
    T, HQ, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    b, h, offs_m, offs_d, row_ok, io_mask = _row_block(T, HQ, HEAD_DIM, BLOCK_D, BLOCK_M)
    acc_rows = ((b * HQ + h) * T + offs_m)[:, None]
    dq = tl.load(DQ_ACC + acc_rows * HEAD_DIM + offs_d[None, :], mask=io_mask, other=0.0) * softmax_scale
    dq_rows = b * stride_dqb + h * stride_dqh + offs_m.to(tl.int64)[:, None] * stride_dqt
    tl.store(DQ + dq_rows + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=io_mask)


@triton.jit
def _dkdv_inner(dk, dv, k, v, first, end, Q_src, DO_src, LSE2_src, DELTA_src, DQ_src, stride_qt, stride_dot,
                lo, hi, full_lo, full_hi, T, qk_scale, offs_m, offs_d, d_ok,
                BLOCK_M: tl.constexpr, MASK: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                HEAD_DIM: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """dK/dV contributions of query tiles lo, lo + BLOCK_M, ... < hi of one query head; key j is seen by
    queries [first_j, end_j). MASK as in :func:`_fwd_inner`. Scores are kept transposed ([keys,
    queries]) as in the Triton tutorial. Q_src, DO_src, LSE2_src, DELTA_src: tensor descriptors
    (USE_TMA) or base pointers. DQ_ATOMIC: also add ``dS k`` (dQ / s) of each tile pair into the
    fp32 rows ``DQ_src [T, HEAD_DIM]`` with atomic adds (the fifth tile product; the dQ kernel is then
    not run)."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < T
        if USE_TMA:
            q = Q_src.load([start_m, 0])
        else:
            qd_mask = d_ok[None, :]
            if MASK != 0:
                qd_mask = qd_mask & row_ok[:, None]
            q_rows = rows.to(tl.int64)[:, None]
            q = tl.load(Q_src + q_rows * stride_qt + offs_d[None, :], mask=qd_mask, other=0.0)
        if USE_TMA:  # no per-row pointers or masks in registers: rows past T read 0 and are masked
            lse2 = LSE2_src.load([start_m])
        else:
            lse2 = tl.load(LSE2_src + rows, mask=row_ok, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASK == 1:
            p_t = tl.where((rows[None, :] >= first[:, None]) & (rows[None, :] < end[:, None]), p_t, 0.0)
        elif MASK == 2:
            if (start_m < full_lo) | (start_m >= full_hi):
                p_t = tl.where((rows[None, :] >= first[:, None]) & (rows[None, :] < end[:, None]), p_t, 0.0)
        if USE_TMA:
            do = DO_src.load([start_m, 0])
        else:
            do = tl.load(DO_src + q_rows * stride_dot + offs_d[None, :], mask=qd_mask, other=0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if USE_TMA:
            delta = DELTA_src.load([start_m])
        else:
            delta = tl.load(DELTA_src + rows, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        if DQ_ATOMIC:  # this key tile's share of dQ / s, added into the fp32 accumulator
            dq_part = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)
            tl.atomic_add(DQ_src + rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], dq_part,
                          mask=(rows < T)[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _flash_attention_bwd_dkdv_kernel(
    Q, K, V, DO,                # q, dO [B, T, Hq, D], k, v [B, S, Hkv, D]: any strides, last dim contiguous
    LSE2, DELTA,                # [B, Hq, T(pitch)] fp32 from the preprocess kernel
    DQ_ACC,                     # with DQ_ATOMIC: [B, Hq, T, D] fp32 dQ / s, zeroed by the preprocess kernel
    DK, DV,                     # out [B, S, Hkv, D] (strides stride_dk*, e.g. slices of a packed gradient)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dot, stride_doh,
    T, S, HQ, stat_pitch,       # lengths, query heads, row pitch of LSE2 and DELTA
    stride_dkb, stride_dks, stride_dkh,  # strides of DK and DV (equal)
    HKV, GROUP,                 # KV heads, query heads per KV head
    shift, window, qk_scale, softmax_scale,  # S - T; window; softmax_scale * log2(e); softmax_scale
    T_BUCKET, S_BUCKET,         # next_pow2(T), next_pow2(S): autotune keys only
    DOCS,                       # with HAS_DOCS: [B, T, 2] int32 document bounds of each position (T == S)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr,  # see the TMA and ONE_LOOP knobs
    HAS_DOCS: tl.constexpr,     # packed documents: a position sees only its own document's positions
    DQ_ATOMIC: tl.constexpr,    # also accumulate dQ (the fused backward, deterministic=False)
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    io_mask = (cols < S)[:, None] & d_ok[None, :]
    kv_rows = cols.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_kb + hk * stride_kh + kv_rows * stride_ks + offs_d[None, :], mask=io_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + kv_rows * stride_vs + offs_d[None, :], mask=io_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # keys past S take the intervals of key S - 1: their rows are never stored
    first, end = _queries_seeing(tl.minimum(cols, S - 1), T, shift, window, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        first, end = _in_document(first, end, DOCS + b * T * 2, tl.minimum(cols, S - 1))
    lo, full_lo, full_hi, hi = _segments(first, end, BLOCK_M)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        Q_src = Q + b * stride_qb + h * stride_qh
        DO_src = DO + b * stride_dob + h * stride_doh
        LSE2_src = LSE2 + (b * HQ + h) * stat_pitch
        DELTA_src = DELTA + (b * HQ + h) * stat_pitch
        DQ_src = DQ_ACC + (b * HQ + h) * T * HEAD_DIM
        if USE_TMA:
            Q_src = tl.make_tensor_descriptor(Q_src, shape=[T, HEAD_DIM], strides=[stride_qt, 1],
                                              block_shape=[BLOCK_M, BLOCK_D])
            DO_src = tl.make_tensor_descriptor(DO_src, shape=[T, HEAD_DIM], strides=[stride_dot, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
            LSE2_src = tl.make_tensor_descriptor(LSE2_src, shape=[T], strides=[1], block_shape=[BLOCK_M])
            DELTA_src = tl.make_tensor_descriptor(DELTA_src, shape=[T], strides=[1], block_shape=[BLOCK_M])
        if ONE_LOOP:
            dk, dv = _dkdv_inner(dk, dv, k, v, first, end, Q_src, DO_src, LSE2_src, DELTA_src, DQ_src,
                                 stride_qt, stride_dot, lo, hi, full_lo, full_hi, T, qk_scale, offs_m, offs_d, d_ok,
                                 BLOCK_M, 2, USE_TMA, DOT_PRECISION, HEAD_DIM, DQ_ATOMIC)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, first, end, Q_src, DO_src, LSE2_src, DELTA_src, DQ_src,
                                 stride_qt, stride_dot, lo, full_lo, full_lo, full_hi, T, qk_scale, offs_m, offs_d, d_ok,
                                 BLOCK_M, 1, USE_TMA, DOT_PRECISION, HEAD_DIM, DQ_ATOMIC)
            dk, dv = _dkdv_inner(dk, dv, k, v, first, end, Q_src, DO_src, LSE2_src, DELTA_src, DQ_src,
                                 stride_qt, stride_dot, full_lo, full_hi, full_lo, full_hi, T, qk_scale, offs_m, offs_d,
                                 d_ok,
                                 BLOCK_M, 0, USE_TMA, DOT_PRECISION, HEAD_DIM, DQ_ATOMIC)
            dk, dv = _dkdv_inner(dk, dv, k, v, first, end, Q_src, DO_src, LSE2_src, DELTA_src, DQ_src,
                                 stride_qt, stride_dot, full_hi, hi, full_lo, full_hi, T, qk_scale, offs_m, offs_d, d_ok,
                                 BLOCK_M, 1, USE_TMA, DOT_PRECISION, HEAD_DIM, DQ_ATOMIC)
    out = (b * stride_dkb + hk * stride_dkh + kv_rows * stride_dks) + offs_d[None, :]
    tl.store(DK + out, (dk * softmax_scale).to(DK.dtype.element_ty), mask=io_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=io_mask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, first, end, K_src, V_src, stride_ks, stride_vs, lo, hi, full_lo, full_hi,
              qk_scale, offs_n, offs_d, d_ok,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ contributions of key tiles lo, lo + BLOCK_N, ... < hi; MASK as in :func:`_fwd_inner`."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k = K_src.load([start_n, 0])
            v = V_src.load([start_n, 0])
        else:
            kv_mask = d_ok[None, :]
            if MASK != 0:
                kv_mask = kv_mask & (cols < hi)[:, None]  # hi <= every key_end
            kv_rows = cols.to(tl.int64)[:, None]
            k = tl.load(K_src + kv_rows * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V_src + kv_rows * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASK == 1:
            p = tl.where((cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None]), p, 0.0)
        elif MASK == 2:
            if (start_n < full_lo) | (start_n >= full_hi):
                p = tl.where((cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None]), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _flash_attention_bwd_dq_kernel(
    Q, K, V, DO,                # q, dO [B, T, Hq, D], k, v [B, S, Hkv, D]: any strides, last dim contiguous
    LSE2, DELTA,                # [B, Hq, T(pitch)] fp32 from the preprocess kernel
    DQ,                         # out [B, T, Hq, D] (strides stride_dq*, e.g. a slice of a packed gradient)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dot, stride_doh,
    T, S, HQ, stat_pitch,       # lengths, query heads, row pitch of LSE2 and DELTA
    stride_dqb, stride_dqt, stride_dqh,
    GROUP,                      # query heads per KV head
    shift, window, qk_scale, softmax_scale,  # S - T; window; softmax_scale * log2(e); softmax_scale
    T_BUCKET, S_BUCKET,         # next_pow2(T), next_pow2(S): autotune keys only
    DOCS,                       # with HAS_DOCS: [B, T, 2] int32 document bounds of each position (T == S)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr,  # see the TMA and ONE_LOOP knobs
    HAS_DOCS: tl.constexpr,     # packed documents: a position sees only its own document's positions
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # last query blocks first: with causal they see the most keys
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = offs_m.to(tl.int64)[:, None]
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_rows * stride_qt + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + q_rows * stride_dot + offs_d[None, :], mask=io_mask,
                 other=0.0)
    stat = (b * HQ + h) * stat_pitch + offs_m
    lse2 = tl.load(LSE2 + stat, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    K_src = K + b * stride_kb + hk * stride_kh
    V_src = V + b * stride_vb + hk * stride_vh
    if USE_TMA:
        K_src = tl.make_tensor_descriptor(K_src, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        V_src = tl.make_tensor_descriptor(V_src, shape=[S, HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first, end = _keys_seen(tl.minimum(offs_m, T - 1), S, shift, window, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        first, end = _in_document(first, end, DOCS + b * T * 2, tl.minimum(offs_m, T - 1))
    lo, full_lo, full_hi, hi = _segments(first, end, BLOCK_N)
    if ONE_LOOP:
        dq = _dq_inner(dq, q, do, lse2, delta, first, end, K_src, V_src, stride_ks, stride_vs, lo, hi, full_lo,
                       full_hi, qk_scale, offs_n, offs_d, d_ok, BLOCK_N, 2, USE_TMA, DOT_PRECISION)
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, first, end, K_src, V_src, stride_ks, stride_vs, lo, full_lo, full_lo,
                       full_hi, qk_scale, offs_n, offs_d, d_ok, BLOCK_N, 1, USE_TMA, DOT_PRECISION)
        dq = _dq_inner(dq, q, do, lse2, delta, first, end, K_src, V_src, stride_ks, stride_vs, full_lo, full_hi,
                       full_lo, full_hi, qk_scale, offs_n, offs_d, d_ok, BLOCK_N, 0, USE_TMA, DOT_PRECISION)
        dq = _dq_inner(dq, q, do, lse2, delta, first, end, K_src, V_src, stride_ks, stride_vs, full_hi, hi, full_lo,
                       full_hi, qk_scale, offs_n, offs_d, d_ok, BLOCK_N, 1, USE_TMA, DOT_PRECISION)
    dq_rows = b * stride_dqb + h * stride_dqh + q_rows * stride_dqt
    tl.store(DQ + dq_rows + offs_d[None, :], (dq * softmax_scale).to(DQ.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------- tuning
# Under the interpreter each kernel gets one fixed config; BLOCK_M != BLOCK_N there so that tile
# edges of queries and keys fall differently. On the GPU: the short lists FWD_CONFIGS, DKDV_CONFIGS,
# DQ_CONFIGS (every autotuned key compiles each config: the lists are kept small so a benchmark run
# does not spend its time compiling), pruned per head dim and dtype, keyed on the head dim, the mask
# kind and the lengths rounded to powers of two. With TRITONLLM_NO_AUTOTUNE=1 (the test suite) each
# kernel runs the first config the pruning keeps (see ``_common.autotune``).

def _tuned(kernel, interp: dict, gpu: list[tuple[dict, int, int]], key: list[str], smem_elems, reg_elems):
    """``kernel`` autotuned over ``gpu`` = [(block sizes, num_warps, num_stages)], keyed on ``key``.

    A config is kept when its planned shared memory ``smem_elems(blocks, BLOCK_D, stages)`` times the
    element size fits the budget and the fp32 tiles live in its loop, ``reg_elems(blocks, BLOCK_D)``
    elements, need at most 192 registers per thread. fp32 inputs (the exact, slow path) and problems
    under ``_TUNE_MIN_PAIRS`` (rounded T x S) keep only the smallest config: nothing to gain from
    compiling and timing the others. Under the interpreter: the single config ``interp``.
    """
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        bd, esize = args["BLOCK_D"], args["Q"].element_size()
        kept = [c for c in configs if smem_elems(c.kwargs, bd, c.num_stages) * esize <= _SMEM_BUDGET
                and reg_elems(c.kwargs, bd) <= 192 * 32 * c.num_warps] or configs[-1:]
        small = "T_BUCKET" in args and args["T_BUCKET"] * args["S_BUCKET"] < _TUNE_MIN_PAIRS
        return kept[-1:] if esize == 4 or small else kept

    if interpreting():
        configs = [triton.Config(interp, num_warps=1, num_stages=1)]
    else:
        configs = [triton.Config(blocks, num_warps=w, num_stages=s) for blocks, w, s in gpu]
    return autotune(configs, key=key, prune_configs_by={"early_config_prune": prune})(kernel)


def _mn(configs: list[tuple[int, int, int, int]]) -> list[tuple[dict, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples as ``_tuned`` wants them."""
    return [({"BLOCK_M": bm, "BLOCK_N": bn}, w, st) for bm, bn, w, st in configs]


_KEYS = ["T_BUCKET", "S_BUCKET", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "USE_TMA", "ONE_LOOP", "HAS_DOCS"]

# forward: q tile and the k, v stages in shared memory; accumulator BLOCK_M x BLOCK_D, scores BLOCK_M x BLOCK_N
_fwd_kernel = _tuned(
    _flash_attention_fwd_kernel, {"BLOCK_M": 32, "BLOCK_N": 16}, _mn(FWD_CONFIGS), _KEYS,
    lambda c, bd, st: bd * (c["BLOCK_M"] + 2 * st * c["BLOCK_N"]),
    lambda c, bd: c["BLOCK_M"] * (bd + c["BLOCK_N"]))

# split-KV decode: BLOCK_M (the group's query rows, <= _SPLIT_MAX_ROWS) is chosen by the launcher
_split_fwd_kernel = _tuned(
    _flash_attention_split_fwd_kernel, {"BLOCK_N": 16},
    [({"BLOCK_N": 128}, 8, 3), ({"BLOCK_N": 128}, 4, 2), ({"BLOCK_N": 64}, 8, 4), ({"BLOCK_N": 64}, 4, 3)],
    ["S_BUCKET", "HEAD_DIM", "BLOCK_M", "CAUSAL", "HAS_WINDOW"],
    lambda c, bd, st: bd * (_SPLIT_MAX_ROWS + 2 * st * c["BLOCK_N"]),
    lambda c, bd: _SPLIT_MAX_ROWS * (bd + c["BLOCK_N"]))

# dK/dV: k, v tiles resident, q and dO tiles pipelined; accumulators dK, dV: 2 x BLOCK_N x BLOCK_D,
# P and dP: 2 x BLOCK_N x BLOCK_M
_dkdv_kernel = _tuned(
    _flash_attention_bwd_dkdv_kernel, {"BLOCK_M": 16, "BLOCK_N": 32}, _mn(DKDV_CONFIGS), _KEYS + ["DQ_ATOMIC"],
    lambda c, bd, st: bd * (2 * c["BLOCK_N"] + 2 * st * c["BLOCK_M"]),
    lambda c, bd: 2 * c["BLOCK_N"] * (bd + c["BLOCK_M"]))

# dQ: q, dO tiles resident, k and v tiles pipelined; accumulator BLOCK_M x BLOCK_D, P and dP 2 x BLOCK_M x BLOCK_N
_dq_kernel = _tuned(
    _flash_attention_bwd_dq_kernel, {"BLOCK_M": 32, "BLOCK_N": 16}, _mn(DQ_CONFIGS), _KEYS,
    lambda c, bd, st: bd * (2 * c["BLOCK_M"] + 2 * st * c["BLOCK_N"]),
    lambda c, bd: c["BLOCK_M"] * (bd + 2 * c["BLOCK_N"]))


# ----------------------------------------------------------------------------- launchers

def _check_documents(documents, q: torch.Tensor, k: torch.Tensor) -> None:
    """``documents``: None or int32 ``[B, T, 2]`` bounds on the device of q, with T == S."""
    if documents is None:
        return
    check_tensor("documents", documents, dtypes=(torch.int32,), ndim=3)
    check_same_device(q=q, documents=documents)
    B, T = q.shape[:2]
    if k.shape[1] != T:
        raise ValueError(f"documents needs as many keys as queries (packed sequences), got T={T} and S={k.shape[1]}")
    if documents.shape != (B, T, 2):
        raise ValueError(f"documents must have shape {(B, T, 2)} [B, T, 2], got {tuple(documents.shape)}")


def _check_attention_inputs(q, k, v, causal, window, softmax_scale) -> float:
    """Validate q, k, v and the options; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    check_same_device(q=q, k=k, v=v)
    check_same_dtype(q=q, k=k, v=v)
    check_dot_dtype("q", q)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, S, Hkv, D], got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    B, T, Hq, D = q.shape
    Bk, S, Hkv, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q and k, v must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if Dk != D:
        raise ValueError(f"q and k, v must have the same head dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"q and k, v must be non-empty, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim D={D} of q, k, v is not supported; expected one of {HEAD_DIMS}")
    if Hq % Hkv != 0:
        raise ValueError(f"the Hq={Hq} heads of q must be a multiple of the Hkv={Hkv} heads of k and v")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys each query sees, itself included), got {window}")
        if not causal:
            raise ValueError("window requires causal=True (a sliding window looks back from each query)")
    if softmax_scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0 or None (1/sqrt(D)), got {softmax_scale!r}")
    return float(softmax_scale)


def _docs_arg(documents: torch.Tensor | None):
    """The DOCS kernel argument: the bounds (contiguous) or 0 (an unused pointer argument)."""
    return 0 if documents is None else documents.contiguous()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, position, head) strides of a [B, L, H, D] tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _kernel_flags(q: torch.Tensor, causal: bool, window: int | None) -> dict:
    D = q.shape[-1]
    return dict(HEAD_DIM=D, BLOCK_D=next_pow2(D), CAUSAL=causal, HAS_WINDOW=window is not None,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


@functools.lru_cache(maxsize=None)
def _tma_device(device: torch.device) -> bool:
    """Tensor descriptors work here: under the interpreter, or on an sm90+ GPU with Triton's TMA API."""
    if interpreting():
        return True
    return hasattr(tl, "make_tensor_descriptor") and torch.cuda.get_device_capability(device)[0] >= 9


def _stream_flags(kernel: str, window: int | None, *streamed: torch.Tensor) -> dict:
    """USE_TMA and ONE_LOOP of ``kernel`` ("fwd", "dkdv", "dq") from the TMA and ONE_LOOP knobs; TMA
    also needs 16-bit ``streamed`` tensors ([B, L, H, D], last dim contiguous) whose base and (batch,
    position, head) strides are 16-byte aligned, the descriptor's base and row pitch."""
    use_tma = (TMA[kernel] and streamed[0].dtype != torch.float32 and _tma_device(streamed[0].device)
               and all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in _strides(t))
                       for t in streamed))
    if use_tma and not interpreting():
        triton.set_allocator(tma_scratch)  # per call: the allocator is per thread (autograd runs backward elsewhere)
    return dict(USE_TMA=use_tma, ONE_LOOP=ONE_LOOP[kernel]["causal" if window is None else "window"])


def _split_rows_block(group: int, T: int) -> int:
    """M tile of the split-KV kernel: the group's query rows, 16 (smallest tl.dot) to _SPLIT_MAX_ROWS."""
    return min(max(next_pow2(group * T), 16), _SPLIT_MAX_ROWS)


def _auto_splits(B: int, T: int, Hq: int, Hkv: int, n_keys: int) -> int:
    """0 for the one-pass kernel, else the number of KV splits of the flash-decoding kernel."""
    if T > _SPLIT_MAX_T and (triton.cdiv(T, 64) * B * Hq >= num_sms() or n_keys < 8 * T):
        return 0
    return _split_count(B, T, Hq, Hkv, n_keys)


def _split_count(B: int, T: int, Hq: int, Hkv: int, n_keys: int) -> int:
    """KV splits of the flash-decoding kernel over ``n_keys`` keys: enough programs for
    ``_SPLIT_WAVES`` per SM, no split under ``_SPLIT_MIN_KEYS`` keys, at least one."""
    base = B * Hkv * triton.cdiv(Hq // Hkv * T, _split_rows_block(Hq // Hkv, T))
    return max(1, min(triton.cdiv(_SPLIT_WAVES * num_sms(), base), triton.cdiv(n_keys, _SPLIT_MIN_KEYS)))


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        window: int | None = None, softmax_scale: float | None = None,
                        split_kv: int | None = None,
                        documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward attention: ``(o [B, T, Hq, D] contiguous, lse fp32 [B, Hq, T])``.

    ``split_kv``: None picks the kernel (split-KV for T <= 16 or when the query blocks cannot fill
    the GPU); 0 forces the one-pass kernel; n >= 1 the split-KV kernel with at most n KV splits.
    ``documents``: see :func:`flash_attention` (one-pass kernel only).
    """
    scale = _check_attention_inputs(q, k, v, causal, window, softmax_scale)
    _check_documents(documents, q, k)
    if split_kv is not None and (isinstance(split_kv, bool) or not isinstance(split_kv, int) or split_kv < 0):
        raise ValueError(f"split_kv must be None or an int >= 0, got {split_kv!r}")
    if documents is not None and split_kv:
        raise ValueError(f"documents needs the one-pass kernel (split_kv None or 0), got split_kv={split_kv}")
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    o = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    flags = _kernel_flags(q, causal, window)
    shift, win, qk_scale = S - T, window or 0, scale * _LOG2E
    key_lo = max(shift - window + 1, 0) if window is not None else 0
    splits = 0 if documents is not None else _auto_splits(B, T, Hq, Hkv, S - key_lo) if split_kv is None else split_kv

    if splits == 0:
        stream = _stream_flags("fwd", window, k, v)
        key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), causal, window, q.dtype, documents is None,
               *stream.values())
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731
        _fwd_kernel.launch(key, grid, q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), T, S, Hq, Hq // Hkv,
                           shift, win, qk_scale, next_pow2(T), next_pow2(S), _docs_arg(documents), **flags,
                           **stream, HAS_DOCS=documents is not None)
        return o, lse

    _split_launch(q, k, v, o, lse, flags, qk_scale, win, key_lo, S - key_lo, splits, None)
    return o, lse


def _split_launch(q, k, v, o, lse, flags: dict, qk_scale: float, win: int, key_lo: int, span: int, splits: int,
                  kv_len: torch.Tensor | None) -> None:
    """Split-KV kernel over keys ``[key_lo, key_lo + span)`` in at most ``splits`` splits, then the
    combine kernel into ``o``, ``lse``. With ``kv_len`` (0-d int tensor on the device) the kernel reads
    the number of valid keys and derives ``shift`` and ``key_lo`` itself; the grid stays sized for
    ``span`` (the cache), so splits past the length see no key (lse -inf: weight 0 in the combine)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    block_m = _split_rows_block(group, T)
    align = max(c.kwargs["BLOCK_N"] for c in _split_fwd_kernel.configs)
    split_size = triton.cdiv(triton.cdiv(span, splits), align) * align
    splits = triton.cdiv(span, split_size)
    o_part = torch.empty((splits, B, Hq, T, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((splits, B, Hq, T), dtype=torch.float32, device=q.device)
    grid = (splits, triton.cdiv(group * T, block_m), B * Hkv)
    _split_fwd_kernel[grid](q, k, v, o_part, lse_part, *_strides(q), *_strides(k), *_strides(v),
                            T, S, Hq, Hkv, group, B * Hq * T, S - T, win, qk_scale, key_lo, split_size,
                            next_pow2(S), 0 if kv_len is None else kv_len, BLOCK_M=block_m,
                            LEN_IN_MEMORY=kv_len is not None, **flags)
    rows_block = _INTERP_COMBINE_ROWS if interpreting() else _COMBINE_ROWS
    _flash_attention_combine_kernel[(triton.cdiv(B * Hq * T, rows_block),)](
        o_part, lse_part, o, lse, B * Hq * T, T, Hq, splits,
        HEAD_DIM=D, BLOCK_D=flags["BLOCK_D"], BLOCK_R=rows_block, num_warps=1 if interpreting() else 4)


def flash_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor,
                           causal: bool = True, window: int | None = None, softmax_scale: float | None = None,
                           split_kv: int | None = None) -> torch.Tensor:
    """Attention of ``q [B, T, Hq, D]`` over the first ``kv_len`` positions of a static KV cache
    ``k_cache, v_cache [B, S_max, Hkv, D]``, with ``kv_len`` a 0-d int32/int64 tensor on the device.

    The split-KV kernel reads ``n = min(kv_len, S_max)`` from device memory and computes exactly
    :func:`flash_attention` ``(q, k_cache[:, :n], v_cache[:, :n], causal, window, softmax_scale)``
    (bottom-right causal: query ``i`` sees keys ``j <= i + n - T``). No host synchronisation and
    shapes independent of ``n``: the grid is sized for ``S_max`` (``split_kv`` splits at most, default
    as for the decode path of :func:`flash_attention_fwd`; with a window, over its last
    ``window + T - 1`` keys), splits past ``n`` do no work and combine with weight 0, so one call
    can be captured in a CUDA graph and replayed as the cache fills. The caller guarantees
    ``T <= n``. Forward only. Returns ``[B, T, Hq, D]`` contiguous, dtype of ``q``.
    """
    scale = _check_attention_inputs(q, k_cache, v_cache, causal, window, softmax_scale)
    if not (isinstance(kv_len, torch.Tensor) and kv_len.dim() == 0 and kv_len.dtype in (torch.int32, torch.int64)):
        got = f"shape {tuple(kv_len.shape)} {kv_len.dtype}" if isinstance(kv_len, torch.Tensor) else type(kv_len).__name__
        raise ValueError(f"kv_len must be a 0-d int32/int64 tensor, got {got}")
    check_same_device(q=q, kv_len=kv_len)
    if split_kv is not None and (isinstance(split_kv, bool) or not isinstance(split_kv, int) or split_kv < 1):
        raise ValueError(f"split_kv must be None or an int >= 1, got {split_kv!r}")
    q, k_cache, v_cache = (_last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    span = S if window is None else min(S, window + T - 1)
    splits = _split_count(B, T, Hq, Hkv, span) if split_kv is None else split_kv
    o = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    _split_launch(q, k_cache, v_cache, o, lse, _kernel_flags(q, causal, window), scale * _LOG2E, window or 0, 0,
                  span, splits, kv_len)
    return o


def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, causal: bool = True, window: int | None = None,
                        softmax_scale: float | None = None, deterministic: bool = True,
                        packed: bool = False,
                        documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward attention from the forward's ``o`` and ``lse``: ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``.

    ``deterministic=True`` (the default, and the faster of the two measured: see
    :func:`flash_attention`): dK/dV and dQ in two kernels without atomics (seven tile products per
    tile pair), bitwise reproducible. ``deterministic=False``: one fused kernel per key block computes
    dK, dV and adds dQ into an fp32 buffer with atomic adds (five products; the order of the additions
    varies between runs, so dQ may differ in the last bits).
    ``packed=True`` (needs ``S == T``): the three gradients are written into one
    ``[B, T, Hq + 2 Hkv, D]`` buffer and returned as its head slices, the layout of the gradient of a
    packed qkv projection (:func:`~tritonllm.kernels.split_heads` then packs them without a copy);
    otherwise each is contiguous.
    """
    bwd = _Backward(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents)
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if packed:
        if S != T:
            raise ValueError(f"packed=True needs as many keys as queries, got T={T} and S={S}")
        buf = torch.empty((B, T, Hq + 2 * Hkv, D), dtype=q.dtype, device=q.device)
        dq, dk, dv = buf.split((Hq, Hkv, Hkv), dim=2)
    else:
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    bwd.run(dq, dk, dv)
    return dq, dk, dv


#: launch plans of the backward's preprocess and dQ finalize kernels per problem
_PREPROCESS_PLANS = Plans()
_FINALIZE_PLANS = Plans()


class _Backward:
    """The backward's inputs, checked, with ``delta = rowsum(dO * O)`` and the base-2 lse from the
    preprocess kernel (which also zeroes the fused backward's dQ accumulator); :meth:`dkdv` and
    :meth:`dq` launch the gradient kernels (separately, so that scripts/tune_attention.py can time
    each), :meth:`run` all of them."""

    def __init__(self, do, q, k, v, o, lse, causal, window, softmax_scale, deterministic=True, documents=None):
        scale = _check_attention_inputs(q, k, v, causal, window, softmax_scale)
        _check_documents(documents, q, k)
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        check_tensor("do", do, ndim=4)
        check_tensor("o", o, ndim=4)
        check_tensor("lse", lse, dtypes=(torch.float32,), ndim=3)
        check_same_device(q=q, do=do, o=o, lse=lse)
        check_same_dtype(q=q, do=do, o=o)
        if do.shape != q.shape or o.shape != q.shape:
            raise ValueError(f"do and o must have the shape of q {tuple(q.shape)}, got do {tuple(do.shape)} "
                             f"and o {tuple(o.shape)}")
        B, T, Hq, D = q.shape
        S, Hkv = k.shape[1], k.shape[2]
        if lse.shape != (B, Hq, T):
            raise ValueError(f"lse must have shape {(B, Hq, T)} [B, Hq, T], got {tuple(lse.shape)}")
        q, k, v, do = (_last_dim_contiguous(t) for t in (q, k, v, do))
        o, lse = o.contiguous(), lse.contiguous()
        self.q, self.k, self.v, self.do, self.window = q, k, v, do, window
        self.scale, self.fused = scale, not deterministic
        self.flags = _kernel_flags(q, causal, window)
        # rows padded to 16 bytes, so that each (b, h) row can be a tensor descriptor
        pitch = triton.cdiv(T, 4) * 4
        self.delta = torch.empty((B, Hq, pitch), dtype=torch.float32, device=q.device)
        self.lse2 = torch.empty((B, Hq, pitch), dtype=torch.float32, device=q.device)
        self.dq_acc = torch.empty((B, Hq, T, D) if self.fused else (0,), dtype=torch.float32, device=q.device)
        do_strides = _strides(do)
        key = (B, T, Hq, D, do_strides, pitch, self.fused)
        preprocess = _PREPROCESS_PLANS.get(key) or _PREPROCESS_PLANS.add(key, Launch(
            _flash_attention_bwd_preprocess_kernel, (triton.cdiv(T, _PREPROCESS_BLOCK_M), B * Hq), HEAD_DIM=D,
            BLOCK_D=self.flags["BLOCK_D"], BLOCK_M=_PREPROCESS_BLOCK_M, ZERO_DQ=self.fused,
            num_warps=1 if interpreting() else 4))
        preprocess(o, do, lse, self.delta, self.lse2, self.dq_acc, *do_strides, T, Hq, pitch)
        # the arguments both gradient kernels share, from the strides on
        self.common = (*_strides(q), *_strides(k), *_strides(v), *do_strides, T, S, Hq, pitch)
        self.scales = (S - T, window or 0, scale * _LOG2E, scale, next_pow2(T), next_pow2(S), _docs_arg(documents))
        self.flags["HAS_DOCS"] = documents is not None
        #: what, besides the streamed tensors' alignment (USE_TMA), fixes the gradient kernels' plans
        self.key = (B, D, Hkv, self.common, causal, window, q.dtype, documents is None)

    def run(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Write the three gradients into ``dq``, ``dk``, ``dv`` (any strides with a contiguous last
        dimension; ``dk`` and ``dv`` with equal strides)."""
        self.dkdv(dk, dv)
        self.dq(dq)

    def dkdv(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        q, k, v, do = self.q, self.k, self.v, self.do
        B, S, Hkv, _ = k.shape
        stream = _stream_flags("dkdv", self.window, q, do)
        _dkdv_kernel.launch(
            (self.key, dk.stride(), self.fused, *stream.values()),
            lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv),
            q, k, v, do, self.lse2, self.delta, self.dq_acc, dk, dv, *self.common, *_strides(dk), Hkv,
            q.shape[2] // Hkv, *self.scales, **self.flags, **stream, DQ_ATOMIC=self.fused)

    def dq(self, dq: torch.Tensor) -> None:
        q, k, v, do = self.q, self.k, self.v, self.do
        B, T, Hq, D = q.shape
        if self.fused:  # dQ / s is in the accumulator: scale and convert
            key = (B, T, Hq, D, dq.stride(), dq.dtype)
            finalize = _FINALIZE_PLANS.get(key) or _FINALIZE_PLANS.add(key, Launch(
                _flash_attention_bwd_dq_finalize_kernel, (triton.cdiv(T, _PREPROCESS_BLOCK_M), B * Hq),
                HEAD_DIM=D, BLOCK_D=self.flags["BLOCK_D"], BLOCK_M=_PREPROCESS_BLOCK_M,
                num_warps=1 if interpreting() else 4))
            finalize(self.dq_acc, dq, *_strides(dq), T, Hq, self.scale)
            return
        stream = _stream_flags("dq", self.window, k, v)
        _dq_kernel.launch(
            (self.key, dq.stride(), *stream.values()), lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq),
            q, k, v, do, self.lse2, self.delta, dq, *self.common, *_strides(dq), Hq // k.shape[2], *self.scales,
            **self.flags, **stream)


# ----------------------------------------------------------------------------- autograd + functional

class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves q, k, v, the output and the fp32 log-sum-exp only."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, softmax_scale, deterministic, documents):
        o, lse = flash_attention_fwd(q, k, v, causal, window, softmax_scale, documents=documents)
        ctx.save_for_backward(q, k, v, o, lse, documents)
        ctx.causal, ctx.window, ctx.softmax_scale, ctx.deterministic = causal, window, softmax_scale, deterministic
        # one gradient buffer for q, k, v when they share the (B, T) of a packed projection
        ctx.packed = q.shape[:2] == k.shape[:2]
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, documents = ctx.saved_tensors
        dq, dk, dv = flash_attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.window, ctx.softmax_scale,
                                         ctx.deterministic, ctx.packed, documents)
        return dq, dk, dv, None, None, None, None, None


@compilable
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    window: int | None = None, softmax_scale: float | None = None,
                    deterministic: bool = True, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``softmax(s * q k^T + mask) v`` with GQA/MQA, computed without the T x S matrix.

    Args:
        q: ``[B, T, Hq, D]`` queries; k, v: ``[B, S, Hkv, D]`` keys and values, ``Hq % Hkv == 0``
            (query head h uses KV head ``h // (Hq // Hkv)``). Any strides with a contiguous last
            dimension (e.g. slices of a packed ``[B, T, Hq + 2 Hkv, D]`` projection).
            D in (32, 64, 96, 128, 256); fp16/bf16 (fp32 accepted, computed exactly, slower).
        causal: query i sees keys ``j <= i + S - T`` (bottom-right aligned, so T = 1 against a KV
            cache of S keys sees them all). Query rows that see no key (T > S) output 0.
        window: sliding window (needs ``causal=True``): query i sees only keys
            ``i + S - T - window < j <= i + S - T``, the last ``window`` keys, itself included.
            Work grows with T * window, not T * S.
        softmax_scale: ``s``, default ``1 / sqrt(D)``.
        deterministic: True (default): the backward without atomics, bitwise reproducible (a dK/dV
            and a dQ kernel, seven tile products per tile pair). False: one fused kernel with five
            products that adds dQ with fp32 atomics, whose order varies between runs. On an H100 with
            Triton 3.6 the atomics cost more than the two products they save (B8 Hq32/Hkv8 T4096 D128
            backward 8.9 ms fused against 7.2 ms; ``docs/perf/NOTES.md``), so the reproducible one is
            also the faster default.
        documents: packed sequences (varlen attention in a ``[B, T]`` batch): int32 ``[B, T, 2]``
            holding, for each position, the first position of its document and one past its last
            (``tritonllm.data.sft.document_bounds`` builds it). A query then sees only keys of its own
            document (with ``causal``, those at or before it), so packed examples never attend to each
            other; tiles wholly outside a query block's documents are skipped. Needs ``T == S``.

    Returns:
        ``[B, T, Hq, D]`` contiguous, in the dtype of q. Differentiable in q, k, v; with ``T == S``
        the three gradients are slices of one ``[B, T, Hq + 2 Hkv, D]`` buffer (a packed qkv
        projection's gradient layout).
    """
    if needs_grad(q, k, v):
        return FlashAttentionFunction.apply(q, k, v, causal, window, softmax_scale, deterministic, documents)
    return flash_attention_fwd(q, k, v, causal, window, softmax_scale, documents=documents)[0]  # nothing to differentiate
