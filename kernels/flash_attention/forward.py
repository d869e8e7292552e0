"""Flash attention forward: the one-pass kernel (a query block per program over its key tiles) and the
split-KV (flash-decoding) kernel with its combine kernel, their launchers and the KV-cache decode entry."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._interpreter import interpreting
from ..checks import check_same_device
from ..custom_op import compilable
from ..launch import next_pow2
from . import forward_sm90
from .checks import check_attention_inputs, check_documents
from .kernel_args import docs_arg, kernel_flags, last_dim_contiguous, stream_flags, strides
from .settings import attention_settings
from .tuning import (COMBINE_ROWS, FWD_CONFIGS, INTERP_COMBINE_ROWS, KEYS, LN2, LOG2E, NEG_INF, SPLIT_MAX_ROWS,
                     auto_splits, block_configs, group_programs, split_count, split_rows_block, tuned)
from .masks import in_document, keys_seen, program_tile, segments

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
            qk = tl.where((cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None]), qk, NEG_INF)
        elif MASK == 2:
            if (start_n < full_lo) | (start_n >= full_hi):
                qk = tl.where((cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None]), qk, NEG_INF)
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
    lo, full_lo, full_hi, hi = segments(first, end, BLOCK_N)
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
    lse = tl.where(empty, NEG_INF, (m_i + tl.math.log2(l_safe)) * LN2)
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
    K_src = K + b * stride_kb + hk * stride_kh
    V_src = V + b * stride_vb + hk * stride_vh
    if USE_TMA:
        K_src = tl.make_tensor_descriptor(K_src, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        V_src = tl.make_tensor_descriptor(V_src, shape=[S, HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    # rows past T take the intervals of row T - 1: they are never stored and must not widen the loop
    first, end = keys_seen(tl.minimum(offs_m, T - 1), S, shift, window, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        first, end = in_document(first, end, DOCS + b * T * 2, tl.minimum(offs_m, T - 1))
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
    first, end = keys_seen(t, tl.minimum(n_lo + split_size, n_keys), shift, window, CAUSAL, HAS_WINDOW)
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
        lse_s = tl.load(LSE_part + part_rows, mask=row_ok, other=NEG_INF) * 1.4426950408889634
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


# forward: q tile and the k, v stages in shared memory; accumulator BLOCK_M x BLOCK_D, scores BLOCK_M x BLOCK_N
_fwd_kernel = tuned(
    _flash_attention_fwd_kernel, {"BLOCK_M": 32, "BLOCK_N": 16}, block_configs(FWD_CONFIGS), KEYS,
    lambda c, bd, st: bd * (c["BLOCK_M"] + 2 * st * c["BLOCK_N"]),
    lambda c, bd: c["BLOCK_M"] * (bd + c["BLOCK_N"]))

# split-KV decode: BLOCK_M (the group's query rows, <= SPLIT_MAX_ROWS) is chosen by the launcher
_split_fwd_kernel = tuned(
    _flash_attention_split_fwd_kernel, {"BLOCK_N": 16},
    [({"BLOCK_N": 128}, 8, 3), ({"BLOCK_N": 128}, 4, 2), ({"BLOCK_N": 64}, 8, 4), ({"BLOCK_N": 64}, 4, 3)],
    ["S_BUCKET", "HEAD_DIM", "BLOCK_M", "CAUSAL", "HAS_WINDOW"],
    lambda c, bd, st: bd * (SPLIT_MAX_ROWS + 2 * st * c["BLOCK_N"]),
    lambda c, bd: SPLIT_MAX_ROWS * (bd + c["BLOCK_N"]))

def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        window: int | None = None, softmax_scale: float | None = None,
                        split_kv: int | None = None,
                        documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward attention: ``(o [B, T, Hq, D] contiguous, lse fp32 [B, Hq, T])``.

    ``split_kv``: None picks the kernel (split-KV for T <= 16 or when the query blocks cannot fill
    the GPU); 0 forces the one-pass kernel; n >= 1 the split-KV kernel with at most n KV splits.
    ``documents``: see :func:`flash_attention` (one-pass kernel only).
    """
    scale = check_attention_inputs(q, k, v, causal, window, softmax_scale)
    check_documents(documents, q, k)
    if split_kv is not None and (isinstance(split_kv, bool) or not isinstance(split_kv, int) or split_kv < 0):
        raise ValueError(f"split_kv must be None or an int >= 0, got {split_kv!r}")
    if documents is not None and split_kv:
        raise ValueError(f"documents needs the one-pass kernel (split_kv None or 0), got split_kv={split_kv}")
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    o = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    flags = kernel_flags(q, causal, window)
    shift, win, qk_scale = S - T, window or 0, scale * LOG2E
    key_lo = max(shift - window + 1, 0) if window is not None else 0
    splits = 0 if documents is not None else auto_splits(B, T, Hq, Hkv, S - key_lo) if split_kv is None else split_kv

    if splits == 0 and q.shape[-1] in attention_settings().sm90_fwd and forward_sm90.supported(q, k, v, window, documents):
        key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), causal, "sm90")
        forward_sm90.launch(q, k, v, o, lse, causal, qk_scale, group_programs("fwd"), key)
        return o, lse
    if splits == 0:
        stream = stream_flags("fwd", window, k, v)
        key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), causal, window, q.dtype, documents is None,
               *stream.values())
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * B * Hq,)  # noqa: E731
        _fwd_kernel.launch(key, grid, q, k, v, o, lse, *strides(q), *strides(k), *strides(v), T, S, Hq, Hq // Hkv,
                           shift, win, qk_scale, next_pow2(T), next_pow2(S), docs_arg(documents),
                           group_programs("fwd"), **flags, **stream, HAS_DOCS=documents is not None)
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
    block_m = split_rows_block(group, T)
    align = max(c.kwargs["BLOCK_N"] for c in _split_fwd_kernel.configs)
    split_size = triton.cdiv(triton.cdiv(span, splits), align) * align
    splits = triton.cdiv(span, split_size)
    o_part = torch.empty((splits, B, Hq, T, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((splits, B, Hq, T), dtype=torch.float32, device=q.device)
    grid = (splits, triton.cdiv(group * T, block_m), B * Hkv)
    _split_fwd_kernel[grid](q, k, v, o_part, lse_part, *strides(q), *strides(k), *strides(v),
                            T, S, Hq, Hkv, group, B * Hq * T, S - T, win, qk_scale, key_lo, split_size,
                            next_pow2(S), 0 if kv_len is None else kv_len, BLOCK_M=block_m,
                            LEN_IN_MEMORY=kv_len is not None, **flags)
    rows_block = INTERP_COMBINE_ROWS if interpreting() else COMBINE_ROWS
    _flash_attention_combine_kernel[(triton.cdiv(B * Hq * T, rows_block),)](
        o_part, lse_part, o, lse, B * Hq * T, T, Hq, splits,
        HEAD_DIM=D, BLOCK_D=flags["BLOCK_D"], BLOCK_R=rows_block, num_warps=1 if interpreting() else 4)


@compilable
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
    scale = check_attention_inputs(q, k_cache, v_cache, causal, window, softmax_scale)
    if not (isinstance(kv_len, torch.Tensor) and kv_len.dim() == 0 and kv_len.dtype in (torch.int32, torch.int64)):
        got = f"shape {tuple(kv_len.shape)} {kv_len.dtype}" if isinstance(kv_len, torch.Tensor) else type(kv_len).__name__
        raise ValueError(f"kv_len must be a 0-d int32/int64 tensor, got {got}")
    check_same_device(q=q, kv_len=kv_len)
    if split_kv is not None and (isinstance(split_kv, bool) or not isinstance(split_kv, int) or split_kv < 1):
        raise ValueError(f"split_kv must be None or an int >= 1, got {split_kv!r}")
    q, k_cache, v_cache = (last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    span = S if window is None else min(S, window + T - 1)
    splits = split_count(B, T, Hq, Hkv, span) if split_kv is None else split_kv
    o = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    _split_launch(q, k_cache, v_cache, o, lse, kernel_flags(q, causal, window), scale * LOG2E, window or 0, 0,
                  span, splits, kv_len)
    return o
