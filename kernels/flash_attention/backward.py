"""Flash attention backward: the preprocess (delta, base-2 lse), the dK/dV kernel (optionally with the
atomic dQ of the fused variant) and its dQ finalize, the dQ kernel, and their launcher."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._interpreter import interpreting
from ..checks import check_same_device, check_same_dtype, check_tensor
from ..launch import Launch, Plans, next_pow2
from . import backward_sm90
from .checks import check_attention_inputs, check_documents
from .kernel_args import docs_arg, kernel_flags, last_dim_contiguous, stream_flags, strides
from .settings import attention_settings
from .tuning import (DKDV_CONFIGS, DQ_CONFIGS, KEYS, LOG2E, NEG_INF, POS_INF, PREPROCESS_BLOCK_M, block_configs,
                     group_programs, tuned)
from .masks import in_document, keys_seen, program_tile, queries_seeing, row_block, segments

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
    b, h, offs_m, offs_d, row_ok, io_mask = row_block(T, HQ, HEAD_DIM, BLOCK_D, BLOCK_M)
    o_rows = ((b * T + offs_m) * HQ + h)[:, None]
    o = tl.load(O + o_rows * HEAD_DIM + offs_d[None, :], mask=io_mask, other=0.0)
    do_rows = offs_m.to(tl.int64)[:, None] * stride_dot
    do = tl.load(DO + b * stride_dob + h * stride_doh + do_rows + offs_d[None, :], mask=io_mask, other=0.0)
    stat = (b * HQ + h) * stat_pitch + offs_m
    tl.store(DELTA + stat, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    # +inf makes the recomputed probabilities of an empty row exp2(s - inf) = 0
    lse = tl.load(LSE + (b * HQ + h) * T + offs_m, mask=row_ok, other=0.0)
    tl.store(LSE2 + stat, tl.where(lse == NEG_INF, POS_INF, lse * 1.4426950408889634), mask=row_ok)
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
    b, h, offs_m, offs_d, row_ok, io_mask = row_block(T, HQ, HEAD_DIM, BLOCK_D, BLOCK_M)
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
    group_programs,             # program order (masks.program_tile; grid: key tiles x B * HKV programs)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr,  # see the TMA and ONE_LOOP knobs
    HAS_DOCS: tl.constexpr,     # packed documents: a position sees only its own document's positions
    DQ_ATOMIC: tl.constexpr,    # also accumulate dQ (the fused backward, deterministic=False)
):
    n_tiles = tl.cdiv(S, BLOCK_N)
    # first key blocks first: with causal they are seen by the most queries
    pid_n, pid_bh = program_tile(tl.program_id(0), n_tiles, tl.num_programs(0) // n_tiles, group_programs)
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
    first, end = queries_seeing(tl.minimum(cols, S - 1), T, shift, window, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        first, end = in_document(first, end, DOCS + b * T * 2, tl.minimum(cols, S - 1))
    lo, full_lo, full_hi, hi = segments(first, end, BLOCK_M)
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
    group_programs,             # program order (masks.program_tile; grid: query tiles x B * HQ programs)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_LOOP: tl.constexpr,  # see the TMA and ONE_LOOP knobs
    HAS_DOCS: tl.constexpr,     # packed documents: a position sees only its own document's positions
):
    n_tiles = tl.cdiv(T, BLOCK_M)
    rank, pid_bh = program_tile(tl.program_id(0), n_tiles, tl.num_programs(0) // n_tiles, group_programs)
    pid_m = n_tiles - 1 - rank  # last query blocks first: with causal they see the most keys
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
    first, end = keys_seen(tl.minimum(offs_m, T - 1), S, shift, window, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        first, end = in_document(first, end, DOCS + b * T * 2, tl.minimum(offs_m, T - 1))
    lo, full_lo, full_hi, hi = segments(first, end, BLOCK_N)
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


# dK/dV: k, v tiles resident, q and dO tiles pipelined; accumulators dK, dV: 2 x BLOCK_N x BLOCK_D,
# P and dP: 2 x BLOCK_N x BLOCK_M
_dkdv_kernel = tuned(
    _flash_attention_bwd_dkdv_kernel, {"BLOCK_M": 16, "BLOCK_N": 32}, block_configs(DKDV_CONFIGS), KEYS + ["DQ_ATOMIC"],
    lambda c, bd, st: bd * (2 * c["BLOCK_N"] + 2 * st * c["BLOCK_M"]),
    lambda c, bd: 2 * c["BLOCK_N"] * (bd + c["BLOCK_M"]))

# dQ: q, dO tiles resident, k and v tiles pipelined; accumulator BLOCK_M x BLOCK_D, P and dP 2 x BLOCK_M x BLOCK_N
_dq_kernel = tuned(
    _flash_attention_bwd_dq_kernel, {"BLOCK_M": 32, "BLOCK_N": 16}, block_configs(DQ_CONFIGS), KEYS,
    lambda c, bd, st: bd * (2 * c["BLOCK_M"] + 2 * st * c["BLOCK_N"]),
    lambda c, bd: c["BLOCK_M"] * (bd + 2 * c["BLOCK_N"]))


def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, causal: bool = True, window: int | None = None,
                        softmax_scale: float | None = None, deterministic: bool = True,
                        documents: torch.Tensor | None = None, *,
                        packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    if packed:
        dqkv = flash_attention_bwd_packed(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents)
        dq, dk, dv = dqkv.split((q.shape[2], k.shape[2], v.shape[2]), dim=2)
        return dq, dk, dv
    bwd = AttentionBackward(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    bwd.run(dq, dk, dv)
    return dq, dk, dv


def flash_attention_bwd_packed(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                               lse: torch.Tensor, causal: bool = True, window: int | None = None,
                               softmax_scale: float | None = None, deterministic: bool = True,
                               documents: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`flash_attention_bwd` into one ``[B, T, Hq + 2 Hkv, D]`` buffer, returned whole: dq, dk and dv
    are its head slices in that order, the gradient of a packed qkv projection. Needs ``S == T``."""
    bwd = AttentionBackward(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents, packed=True)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    dqkv = torch.empty((B, T, Hq + 2 * Hkv, D), dtype=q.dtype, device=q.device)
    bwd.run(*dqkv.split((Hq, Hkv, Hkv), dim=2))
    return dqkv


#: launch plans of the backward's preprocess and dQ finalize kernels per problem
_PREPROCESS_PLANS = Plans()
_FINALIZE_PLANS = Plans()


class AttentionBackward:
    """The backward's inputs, checked, with ``delta = rowsum(dO * O)`` and the base-2 lse from the
    preprocess kernel (which also zeroes the fused backward's dQ accumulator); :meth:`dkdv` and
    :meth:`dq` launch the gradient kernels (separately, so that scripts/tune_attention.py can time
    each), :meth:`run` all of them. ``packed``: the gradients will be slices of one packed qkv
    gradient, which needs as many keys as queries (checked before any launch)."""

    def __init__(self, do, q, k, v, o, lse, causal, window, softmax_scale, deterministic=True, documents=None,
                 packed=False):
        scale = check_attention_inputs(q, k, v, causal, window, softmax_scale)
        check_documents(documents, q, k)
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
        if packed and S != T:
            raise ValueError(f"packed=True needs as many keys as queries, got T={T} and S={S}")
        if lse.shape != (B, Hq, T):
            raise ValueError(f"lse must have shape {(B, Hq, T)} [B, Hq, T], got {tuple(lse.shape)}")
        q, k, v, do = (last_dim_contiguous(t) for t in (q, k, v, do))
        o, lse = o.contiguous(), lse.contiguous()
        self.q, self.k, self.v, self.do, self.window = q, k, v, do, window
        self.scale, self.fused = scale, not deterministic
        self.flags = kernel_flags(q, causal, window)
        # rows padded to 16 bytes, so that each (b, h) row can be a tensor descriptor
        pitch = triton.cdiv(T, 4) * 4
        self.delta = torch.empty((B, Hq, pitch), dtype=torch.float32, device=q.device)
        self.lse2 = torch.empty((B, Hq, pitch), dtype=torch.float32, device=q.device)
        self.dq_acc = torch.empty((B, Hq, T, D) if self.fused else (0,), dtype=torch.float32, device=q.device)
        do_strides = strides(do)
        key = (B, T, Hq, D, do_strides, pitch, self.fused)
        preprocess = _PREPROCESS_PLANS.get(key) or _PREPROCESS_PLANS.add(key, Launch(
            _flash_attention_bwd_preprocess_kernel, (triton.cdiv(T, PREPROCESS_BLOCK_M), B * Hq), HEAD_DIM=D,
            BLOCK_D=self.flags["BLOCK_D"], BLOCK_M=PREPROCESS_BLOCK_M, ZERO_DQ=self.fused,
            num_warps=1 if interpreting() else 4))
        preprocess(o, do, lse, self.delta, self.lse2, self.dq_acc, *do_strides, T, Hq, pitch)
        # the arguments both gradient kernels share, from the strides on
        self.common = (*strides(q), *strides(k), *strides(v), *do_strides, T, S, Hq, pitch)
        self.scales = (S - T, window or 0, scale * LOG2E, scale, next_pow2(T), next_pow2(S), docs_arg(documents))
        self.flags["HAS_DOCS"] = documents is not None
        settings = attention_settings()
        #: the gradient kernels ("dkdv", "dq") that run backward_sm90's Gluon kernel here (the sm90_bwd setting),
        #: each with the arguments both take
        #: (the fused backward: its dK/dV kernel's DQ_REDUCE variant, dQ by TMA bulk reduces, where sm90_fused names D)
        gluon = ([name for name in ("dkdv",) if D in settings.sm90_fused] if self.fused else
                 [name for name, dims in settings.sm90_bwd.items() if D in dims])
        args = backward_sm90.matrix_args(q, k, v, do, window, documents) if gluon else None
        self.sm90 = dict.fromkeys(gluon, args) if args is not None else {}
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
        if "dkdv" in self.sm90:
            backward_sm90.launch_dkdv(q, k, v, do, self.lse2, self.delta, dk, dv, self.sm90["dkdv"], self.flags["CAUSAL"],
                                      self.scale, self.scales[2], group_programs("dkdv"), (self.key, dk.stride(), "sm90"),
                                      self.dq_acc if self.fused else None)
            return
        stream = stream_flags("dkdv", self.window, q, do)
        _dkdv_kernel.launch(
            (self.key, dk.stride(), self.fused, *stream.values()),
            lambda meta: (triton.cdiv(S, meta["BLOCK_N"]) * B * Hkv,),
            q, k, v, do, self.lse2, self.delta, self.dq_acc, dk, dv, *self.common, *strides(dk), Hkv,
            q.shape[2] // Hkv, *self.scales, group_programs("dkdv"), **self.flags, **stream,
            DQ_ATOMIC=self.fused)

    def dq(self, dq: torch.Tensor) -> None:
        q, k, v, do = self.q, self.k, self.v, self.do
        B, T, Hq, D = q.shape
        if self.fused:  # dQ / s is in the accumulator: scale and convert
            key = (B, T, Hq, D, dq.stride(), dq.dtype)
            finalize = _FINALIZE_PLANS.get(key) or _FINALIZE_PLANS.add(key, Launch(
                _flash_attention_bwd_dq_finalize_kernel, (triton.cdiv(T, PREPROCESS_BLOCK_M), B * Hq),
                HEAD_DIM=D, BLOCK_D=self.flags["BLOCK_D"], BLOCK_M=PREPROCESS_BLOCK_M,
                num_warps=1 if interpreting() else 4))
            finalize(self.dq_acc, dq, *strides(dq), T, Hq, self.scale)
            return
        if "dq" in self.sm90:
            backward_sm90.launch_dq(q, k, v, do, self.lse2, self.delta, dq, self.sm90["dq"], self.flags["CAUSAL"],
                                    self.scale, self.scales[2], group_programs("dq"), (self.key, dq.stride(), "sm90"))
            return
        stream = stream_flags("dq", self.window, k, v)
        _dq_kernel.launch(
            (self.key, dq.stride(), *stream.values()), lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * B * Hq,),
            q, k, v, do, self.lse2, self.delta, dq, *self.common, *strides(dq), Hq // k.shape[2], *self.scales,
            group_programs("dq"), **self.flags, **stream)
