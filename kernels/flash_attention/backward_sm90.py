"""Flash attention backward for Hopper (sm90), written in Gluon: the deterministic backward's dK/dV and dQ
kernels with the tensor-core products of one tile in flight while the softmax gradient of the same tile
runs, and the next tile's products issued before the last tile's accumulation is waited for.

dK/dV: a program owns BLOCK_N keys of one KV head (one or two warpgroups, 64 keys each) and keeps k and v
in shared memory; q and dO tiles of BLOCK_M queries stream through a NUM_BUF-deep ring (TMA, one mbarrier
per slot), over every query head of the group and every query tile that sees these keys. Per tile, with
scores kept transposed ([keys, queries]) as in :func:`backward._dkdv_inner`:

    issue S^T = k q^T, dP^T = v dO^T                   (async; retires the last tile's dV, dK products)
    wait S^T; P^T = exp2(S^T * scale * log2 e - lse2); mask     (overlaps dP^T)
    issue dV += P^T dO                                  (async)
    wait dP^T; dS^T = P^T (dP^T - delta)                (overlaps dV; with DV_WAIT, dV is waited for
                                                         here too, freeing P^T's registers)
    issue dK += dS^T q                                  (async; waited in the next tile)
    load the next tile's lse2                           (its latency under dK and the next S^T)

dQ: a program (persistent: it takes query blocks from a global counter until none is left, each computed
in a fixed order whichever program takes it) owns BLOCK_M queries of one head at a time with q and dO
resident, and streams k and v tiles the same way: issue S = q k^T and dP = dO v^T; P while dP runs; issue
dQ += dS k, waited in the next tile.

With ``DQ_REDUCE`` (the backward of ``deterministic=False``) the dK/dV kernel also computes each tile's
share of dQ, FlashAttention's fifth product, and no dQ kernel runs, in FlashAttention-3's arrangement:
dS^T goes to shared memory and is the A operand of dK and (transposed) of dQ_tile = dS k, issued in
DQ_CHUNK-column chunks; the compute warps stage each chunk (fp32) in a ring of DQ_SLOTS slots and hand it
by mbarrier to a writer warp of its own (``gl.warp_specialize``), which adds it into a zeroed
``[B, Hq, T, D]`` accumulator by a TMA bulk reduce (``cp.reduce.async.bulk.tensor.add``: the adds done in
L2) and frees the slot once the reduce has read it; ``backward.py``'s finalize kernel scales the
accumulator into dQ. Five products per tile pair instead of seven; the order in which the key blocks' adds
land varies between runs.

dK = softmax_scale * sum dS^T q, dV = sum P^T dO over the group's query heads and dQ = softmax_scale *
sum dS k, each in a fixed order without DQ_REDUCE: no atomic adds (the dQ kernel's counter only hands out
work), so the backward stays bitwise reproducible.
Only 16-bit q, k, v, dO on sm90, head dim 64 or 128, causal or not, no window and no documents, q and dO
with each token's heads side by side or each head's tokens in a row (a head is then a column or a row
block of one descriptor per batch entry: :func:`_head_rows`; :func:`matrix_args`); ``AttentionSettings.sm90_bwd``
names, per kernel, the head dims it runs at, ``AttentionSettings.sm90_fused`` those of DQ_REDUCE.
"""

from __future__ import annotations

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from ..device import num_sms, smem_budget
from ..launch import autotune, next_pow2
from ..scratch import tile_counter, tma_scratch
from .forward_sm90 import descriptor4, supported, wgmma_layout
from .masks import program_tile

_program_tile = gluon.jit(program_tile.fn)

#: (BLOCK_M, BLOCK_N, num_warps, NUM_BUF[, DV_WAIT]) the autotuners try, the first one pinned
#: (TRITONLLM_NO_AUTOTUNE=1). dK/dV: BLOCK_N keys a program (64 a warpgroup), q and dO tiles of BLOCK_M
#: queries through a NUM_BUF-deep ring; DV_WAIT: see the kernel. dQ: BLOCK_M queries a program, k and v
#: tiles of BLOCK_N keys through the ring. 64x64 w4 b2 (98 KB of shared memory): two programs an SM.
#: Offline sm_90 compile at D128, causal: dK/dV 32x128 227 registers, no spills; with DV_WAIT 64x128
#: spills 20 (b3) and 40 (b2) bytes (188-228 without), 64x64 w4 b2 16; dQ 170-253 registers, no spills.
#: H100, dK/dV at B8 Hq32/Hkv8 T4096 / B1 T16384 D128 (attention-sm90-h100.json): 64x64 w4 b2 4.26 /
#: 7.11 ms, 64x128 b2 4.53 / 8.06, 64x128 b3 4.53 / 8.17, 32x128 5.93 / 10.51; the portable one 4.36 / 8.21.
DKDV_CONFIGS = [(64, 64, 4, 2, True), (64, 128, 8, 2, True), (64, 128, 8, 3, True), (32, 128, 8, 3, False)]
#: dQ: persistent programs (query tiles from a global counter). H100, dQ alone (docs/perf/history.md, a01a1ec):
#: 64x64 w4 b2 0.112 / 0.205 / 2.72 / 4.96 ms at B16 Hq12 T1024 D64, B4 Hq16/Hkv4 T2048, B8 Hq32/Hkv8 T4096, B1 T16384 D128,
#: against 0.132 / 0.217 / 2.88 / 4.99 one tile a program and 0.117 / 0.224 / 3.07 / 5.44 for the portable
#: kernel; the 128-row tile 8-15% slower (one tile a program: 128x64 b3 and 128x128 b2 no better, dropped).
DQ_CONFIGS = [(64, 64, 4, 2), (128, 64, 8, 2)]
#: the persistent dQ's grid, in programs an SM: at least as many as fit at once (the 64x64 tile: two at D128,
#: three at D64 by registers); a program that finds no room starts once another has found no tile left,
#: and ends at once
DQ_PROGRAMS_PER_SM = 4
#: the dK/dV kernel with DQ_REDUCE (64 queries a tile: the dQ chunk's rows, one warpgroup's wgmma height).
#: 64x128 halves the reduces of 64x64. Not yet measured (docs/perf/history.md).
DKDV_REDUCE_CONFIGS = [(64, 128, 8, 2, True), (64, 128, 8, 3, True), (64, 64, 4, 2, True)]
#: DQ_REDUCE: the columns of a dQ chunk (a 128-byte swizzle atom of the k tile: the B operand's slice) ...
DQ_CHUNK = gl.constexpr(64)
#: ... the staging slots between the compute warps and the writer warp ...
DQ_SLOTS = gl.constexpr(2)
#: ... and the writer warp's registers (setmaxnreg; the compute warps get the rest)
DQ_WRITER_REGS = gl.constexpr(24)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add shared-memory tile ``src`` into the global block of ``tensor_desc`` at ``coord`` (a TMA bulk reduce,
    ``cp.reduce.async.bulk.tensor.add``): issued by one thread, done in L2, tracked like a TMA store
    (``tma.store_wait``). Triton 3.6's Gluon builds the op but exports no function for it on Hopper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _descriptors(Q, K, V, DO, b, hk, stride_qb, stride_qt, q_rows, q_cols, stride_dob, stride_dot, do_rows, do_cols,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, S, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA descriptors of batch entry b: its queries and dO each as one matrix whose blocks are the heads
    (tiles of BLOCK_M rows), and KV head hk's keys and values (tiles of BLOCK_N rows)."""
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb, shape=[q_rows, q_cols], strides=[stride_qt, 1],
                                        block_shape=[BLOCK_M, HEAD_DIM], layout=tile_layout)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob, shape=[do_rows, do_cols], strides=[stride_dot, 1],
                                         block_shape=[BLOCK_M, HEAD_DIM], layout=tile_layout)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + hk * stride_kh, shape=[S, HEAD_DIM],
                                        strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=tile_layout)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + hk * stride_vh, shape=[S, HEAD_DIM],
                                        strides=[stride_vs, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=tile_layout)
    return q_desc, do_desc, k_desc, v_desc


@gluon.jit
def _buffers(dtype: gl.constexpr, ROWS: gl.constexpr, RING_ROWS: gl.constexpr, NUM_BUF: gl.constexpr,
             HEAD_DIM: gl.constexpr):
    """A program's shared memory: two resident tiles of ROWS rows (one barrier for both), and two rings of
    NUM_BUF tiles of RING_ROWS rows (a barrier per slot for both rings' tiles), the barriers initialised;
    128-byte swizzled, as every descriptor's tiles."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    a = gl.allocate_shared_memory(dtype, [ROWS, HEAD_DIM], layout)
    b = gl.allocate_shared_memory(dtype, [ROWS, HEAD_DIM], layout)
    ring_a = gl.allocate_shared_memory(dtype, [NUM_BUF, RING_ROWS, HEAD_DIM], layout)
    ring_b = gl.allocate_shared_memory(dtype, [NUM_BUF, RING_ROWS, HEAD_DIM], layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
    return a, b, ring_a, ring_b, bar, ready


@gluon.jit
def _load_tile(q_desc, do_desc, q_smem, do_smem, ready, it, ok, n_m, lo, h0, q_head, do_head):
    """Issue the TMA loads of streamed tile ``it`` (query head h = h0 + it // n_m, query rows m = lo +
    (it % n_m) * BLOCK_M, at [m + h * rows, h * cols] of a descriptor with per-head offsets
    ``(rows, cols)`` = q_head / do_head) into ring slot it % NUM_BUF, if ``ok``."""
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    s = it % NUM_BUF
    m = lo + (it % n_m) * BLOCK_M
    h = h0 + it // n_m
    mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(q_desc, [m + h * q_head[0], h * q_head[1]], ready.index(s), q_smem.index(s),
                                    pred=ok)
    tma.async_copy_global_to_shared(do_desc, [m + h * do_head[0], h * do_head[1]], ready.index(s), do_smem.index(s),
                                    pred=ok)


@gluon.jit
def _sm90_dkdv_kernel(
    Q, K, V, DO,                # q, dO [B, T, Hq, D], k, v [B, S, Hkv, D]: 16-byte aligned rows (see _head_rows)
    LSE2, DELTA,                # [B, Hq, T(pitch)] fp32 from the preprocess kernel (lse2 +inf: a row saw no key)
    DK, DV,                     # out [B, S, Hkv, D] (equal strides, last dim contiguous)
    DQ_ACC,                     # DQ_REDUCE: [B, Hq, T, D] fp32, zeroed: dQ / softmax_scale is added into it
    stride_qb, stride_qt, q_rows, q_cols, q_head_rows, q_head_cols,    # q of one batch entry as a [q_rows, q_cols]
    stride_dob, stride_dot, do_rows, do_cols, do_head_rows, do_head_cols,  # matrix, head h at its (h * head_rows,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,      # h * head_cols) block (_head_rows); dO too
    stride_dkb, stride_dks, stride_dkh,
    T, S, HQ, HKV, stat_pitch, shift, qk_scale, softmax_scale, group_programs,
    T_BUCKET, S_BUCKET,         # next_pow2(T), next_pow2(S): autotune keys only
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr,
    DV_WAIT: gl.constexpr,      # wait for a tile's dV product before its dS: P's registers freed, less overlap
    CAUSAL: gl.constexpr,
    DQ_REDUCE: gl.constexpr,    # also add each tile's dS k into DQ_ACC through a writer warp (see the module doc)
):
    GROUP = HQ // HKV
    n_tiles = gl.cdiv(S, BLOCK_N)
    # first key blocks first: with causal they are seen by the most queries
    pid_n, pid_bh = _program_tile(gl.program_id(0), n_tiles, gl.num_programs(0) // n_tiles, group_programs)
    hk = pid_bh % HKV
    b = (pid_bh // HKV).to(gl.int64)
    n0 = pid_n * BLOCK_N
    q_desc, do_desc, k_desc, v_desc = _descriptors(
        Q, K, V, DO, b, hk, stride_qb, stride_qt, q_rows, q_cols, stride_dob, stride_dot, do_rows, do_cols,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, S, HEAD_DIM, BLOCK_M, BLOCK_N)
    k_smem, v_smem, q_smem, do_smem, kv_bar, ready = _buffers(q_desc.dtype, BLOCK_N, BLOCK_M, NUM_BUF, HEAD_DIM)

    # the query tiles that see keys n0 ..: from the one holding row n0 - shift (causal) to T; those that
    # start at or after full_from see every key of the block (no mask)
    if CAUSAL:
        lo = (gl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
        full_from = n0 + BLOCK_N - 1 - shift
    else:
        lo = 0
        full_from = 0
    n_m = gl.maximum(gl.cdiv(T - lo, BLOCK_M), 0)
    n_iter = GROUP * n_m  # may be 0: dK = dV = 0 are still stored
    h0 = hk * GROUP
    descs = (q_desc, do_desc, k_desc, v_desc)
    smem = (k_smem, v_smem, q_smem, do_smem, kv_bar, ready)
    problem = (LSE2, DELTA, DK, DV, b, hk, n0, lo, full_from, n_m, n_iter, h0, q_head_rows, q_head_cols,
               do_head_rows, do_head_cols, stride_dkb, stride_dks, stride_dkh, T, S, HQ, stat_pitch, shift, qk_scale,
               softmax_scale)
    if DQ_REDUCE:
        gl.static_assert(DV_WAIT and BLOCK_M == 64, "DQ_REDUCE needs DV_WAIT and BLOCK_M 64")
        staging_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        dq_desc = tma.make_tensor_descriptor(DQ_ACC + b * HQ * T * HEAD_DIM, shape=[HQ * T, HEAD_DIM],
                                             strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, DQ_CHUNK],
                                             layout=staging_layout)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2))
        staging = gl.allocate_shared_memory(gl.float32, [DQ_SLOTS, BLOCK_M, DQ_CHUNK], staging_layout)
        dq_full = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(DQ_SLOTS):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        dq = (ds_smem, staging, dq_full, dq_empty)
        gl.warp_specialize([
            (_dkdv_body, (descs, smem, problem, dq, HEAD_DIM, BLOCK_N, BLOCK_M, NUM_BUF, DV_WAIT, CAUSAL, True)),
            (_dq_writer, (dq_desc, staging, dq_full, dq_empty, n_iter, n_m, lo, h0, T, HEAD_DIM)),
        ], [1], [DQ_WRITER_REGS])
    else:
        _dkdv_body(descs, smem, problem, (0, 0, 0, 0), HEAD_DIM, BLOCK_N, BLOCK_M, NUM_BUF, DV_WAIT, CAUSAL, False)


@gluon.jit
def _dq_writer(dq_desc, staging, dq_full, dq_empty, n_iter, n_m, lo, h0, T, HEAD_DIM: gl.constexpr):
    """The DQ_REDUCE writer warp: chunk after chunk (a tile's HEAD_DIM / DQ_CHUNK column chunks in turn), wait
    until the consumers have staged it, add it into the accumulator by a TMA bulk reduce, and free its slot
    once the reduce has read it (the adds complete in L2 on their own)."""
    BLOCK_M: gl.constexpr = staging.type.shape[1]
    CHUNKS: gl.constexpr = HEAD_DIM // DQ_CHUNK
    for i in range(n_iter * CHUNKS):
        it = i // CHUNKS
        slot = i % DQ_SLOTS
        mbarrier.wait(dq_full.index(slot), (i // DQ_SLOTS) & 1)
        _tma_reduce_add(dq_desc, [(h0 + it // n_m) * T + lo + (it % n_m) * BLOCK_M, (i % CHUNKS) * DQ_CHUNK],
                        staging.index(slot))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(slot), count=1)


@gluon.jit
def _dkdv_body(descs, smem, problem, dq, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
               NUM_BUF: gl.constexpr, DV_WAIT: gl.constexpr, CAUSAL: gl.constexpr, DQ_REDUCE: gl.constexpr):
    """The dK/dV kernel's work (all its warps; with DQ_REDUCE the default partition beside the writer warp):
    the tile loop of the module doc, then dK and dV stored."""
    q_desc, do_desc, k_desc, v_desc = descs
    k_smem, v_smem, q_smem, do_smem, kv_bar, ready = smem
    (LSE2, DELTA, DK, DV, b, hk, n0, lo, full_from, n_m, n_iter, h0, q_head_rows, q_head_cols, do_head_rows,
     do_head_cols, stride_dkb, stride_dks, stride_dkh, T, S, HQ, stat_pitch, shift, qk_scale, softmax_scale) = problem
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = wgmma_layout(NW, BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(NW, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_head = (q_head_rows, q_head_cols)
    do_head = (do_head_rows, do_head_cols)
    if DQ_REDUCE:
        ds_smem, staging, dq_full, dq_empty = dq
        # a dQ chunk [BLOCK_M, DQ_CHUNK]: one warpgroup's 64 rows, its columns split between warpgroups
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                            instr_shape=[16, DQ_CHUNK // (NW // 4), 16])
        dq_zero = gl.zeros([BLOCK_M, DQ_CHUNK], gl.float32, dq_layout)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    for j in gl.static_range(NUM_BUF):
        _load_tile(q_desc, do_desc, q_smem, do_smem, ready, j, j < n_iter, gl.maximum(n_m, 1), lo, h0, q_head, do_head)

    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    # the register operands of the last tile's dV and dK products, kept alive until those are done (P's
    # only into the next tile without DV_WAIT)
    p16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, op_layout)
    ds16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, op_layout)
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    # the first tile's lse2 (rows past T: +inf, so p = 0); each tile loads the next one's after issuing its
    # last product, so that the load's latency passes under that product and the next tile's first two
    lse2 = gl.load(LSE2 + (b * HQ + h0) * stat_pitch + lo + offs_m, mask=(lo + offs_m < T) & (n_iter > 0),
                   other=float("inf"))
    mbarrier.wait(kv_bar, 0)

    for it in range(n_iter):
        start_m = lo + (it % n_m) * BLOCK_M
        rows = start_m + offs_m
        s = it % NUM_BUF
        mbarrier.wait(ready.index(s), (it // NUM_BUF) & 1)
        st_tok = warpgroup_mma(k_smem, q_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_smem, do_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # S^T done, and with it the last tile's dV and dK (issued before): its ring slot is free again
        if DQ_REDUCE:  # as DV_WAIT, and dK's operand dS^T is in shared memory
            st, dv_r, dk_r = warpgroup_mma_wait(1, deps=(st_tok, dv, dk))
        elif DV_WAIT:  # the last tile's dV product was waited for in that tile: P's registers are free
            st, dv_r, dk_r, ds16 = warpgroup_mma_wait(1, deps=(st_tok, dv, dk, ds16))
        else:
            st, dv_r, dk_r, p16, ds16 = warpgroup_mma_wait(1, deps=(st_tok, dv, dk, p16, ds16))
        nxt = it - 1 + NUM_BUF
        _load_tile(q_desc, do_desc, q_smem, do_smem, ready, nxt, (it > 0) & (nxt < n_iter), n_m, lo, h0, q_head,
                   do_head)
        # delta, first needed after dP^T: loaded here, not with lse2, which would keep it in registers
        # through the loop's end (spills at 64x128)
        delta = gl.load(DELTA + (b * HQ + h0 + it // n_m) * stat_pitch + rows, mask=rows < T, other=0.0)
        p = gl.exp2(st * qk_scale - lse2[None, :])
        if CAUSAL:
            if start_m < full_from:
                p = gl.where(keys[:, None] <= rows[None, :] + shift, p, 0.0)
        p16 = gl.convert_layout(p.to(dtype), op_layout)
        dv = warpgroup_mma(p16, do_smem.index(s), dv_r, is_async=True)
        if DV_WAIT:
            dpt, dv_done, p16_done = warpgroup_mma_wait(0, deps=(dpt_tok, dv, p16))
        else:
            dpt = warpgroup_mma_wait(1, deps=(dpt_tok,))
        ds = (p * (dpt - delta[None, :])).to(dtype)
        if DQ_REDUCE:  # dS^T through shared memory: the A operand of dQ (transposed) and of dK
            ds_smem.store(ds)
            fence_async_shared()
            # rows past T have P = 0: their dQ rows are 0, and may land in the next head's rows harmlessly
            dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(0, DQ_CHUNK, dim=1), dq_zero,
                                   use_acc=False, is_async=True)
            dk = warpgroup_mma(ds_smem, q_smem.index(s), dk_r, is_async=True)
            for c in gl.static_range(HEAD_DIM // DQ_CHUNK):
                if c > 0:
                    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(c * DQ_CHUNK, DQ_CHUNK, dim=1),
                                           dq_zero, use_acc=False, is_async=True)
                dq_chunk = warpgroup_mma_wait(1 if c == 0 else 0, deps=(dq_tok,))
                i = it * (HEAD_DIM // DQ_CHUNK) + c  # the writer's chunk count
                slot = i % DQ_SLOTS
                mbarrier.wait(dq_empty.index(slot), ((i // DQ_SLOTS) & 1) ^ 1)  # a slot starts free
                staging.index(slot).store(dq_chunk)
                fence_async_shared()
                gl.thread_barrier()  # every consumer thread's part of the chunk is stored
                mbarrier.arrive(dq_full.index(slot), count=1)
        else:
            ds16 = gl.convert_layout(ds, op_layout)
            dk = warpgroup_mma(ds16, q_smem.index(s), dk_r, is_async=True)
        rows_next = lo + ((it + 1) % n_m) * BLOCK_M + offs_m
        lse2 = gl.load(LSE2 + (b * HQ + h0 + (it + 1) // n_m) * stat_pitch + rows_next,
                       mask=(rows_next < T) & (it + 1 < n_iter), other=float("inf"))

    if DQ_REDUCE:
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    elif DV_WAIT:
        dv, dk, ds16 = warpgroup_mma_wait(0, deps=(dv, dk, ds16))
    else:
        dv, dk, p16, ds16 = warpgroup_mma_wait(0, deps=(dv, dk, p16, ds16))
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(i))
    out_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    out = b * stride_dkb + hk * stride_dkh + out_rows.to(gl.int64)[:, None] * stride_dks + out_cols[None, :]
    keep = (out_rows < S)[:, None]
    gl.store(DK + out, (dk * softmax_scale).to(DK.dtype.element_ty), mask=keep)
    gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=keep)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, ready, slot, b, hk, it, ok):
    """Issue the TMA loads of key tile ``it`` of KV head (b, hk) (k and v, through [B, H, S, D] descriptors)
    into ring slot ``slot`` % NUM_BUF, if ``ok``."""
    NUM_BUF: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    s = slot % NUM_BUF
    mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(k_desc, [b, hk, it * BLOCK_N, 0], ready.index(s),
                                    k_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]), pred=ok)
    tma.async_copy_global_to_shared(v_desc, [b, hk, it * BLOCK_N, 0], ready.index(s),
                                    v_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]), pred=ok)


@gluon.jit
def _sm90_dq_kernel(
    Q, K, V, DO, LSE2, DELTA,   # as in _sm90_dkdv_kernel
    DQ,                         # out [B, T, Hq, D] (last dim contiguous)
    stride_qb, stride_qt, q_rows, q_cols, q_head_rows, q_head_cols,
    stride_dob, stride_dot, do_rows, do_cols, do_head_rows, do_head_cols,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dqb, stride_dqt, stride_dqh,
    T, S, HQ, HKV, stat_pitch, shift, qk_scale, softmax_scale, group_programs,
    B, COUNTER,                 # batch size; int32 [2] zeros (scratch.tile_counter)
    T_BUCKET, S_BUCKET,         # next_pow2(T), next_pow2(S): autotune keys only
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """dQ of BLOCK_M query rows of one head: q, dO resident, k and v tiles through a NUM_BUF-deep ring.
    Per key tile: issue S = q k^T and dP = dO v^T; P while dP runs; dS = P (dP - delta); issue dQ += dS k,
    left in flight into the next tile (whose first wait frees this tile's slot). A program runs query tile
    after query tile, taken from the global ``COUNTER`` (in the order of :func:`masks.program_tile`) until
    none is left, with its descriptors, buffers and barriers set up once and its ring slots counted across
    its tiles; the last program to finish zeroes the counter again."""
    n_tiles = gl.cdiv(T, BLOCK_M)
    n_work = n_tiles * B * HQ
    # [B, H, L, D] views: head h of one batch entry's matrix (_head_rows) is its block at (h * head_rows, h * head_cols)
    q_desc = descriptor4(Q, B, HQ, T, stride_qb, q_head_rows * stride_qt + q_head_cols, stride_qt, BLOCK_M, HEAD_DIM)
    do_desc = descriptor4(DO, B, HQ, T, stride_dob, do_head_rows * stride_dot + do_head_cols, stride_dot, BLOCK_M,
                           HEAD_DIM)
    k_desc = descriptor4(K, B, HKV, S, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM)
    v_desc = descriptor4(V, B, HKV, S, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM)
    dtype: gl.constexpr = Q.dtype.element_ty
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = wgmma_layout(NW, BLOCK_N)
    acc_layout: gl.constexpr = wgmma_layout(NW, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_smem, do_smem, k_smem, v_smem, qd_bar, ready = _buffers(dtype, BLOCK_M, BLOCK_N, NUM_BUF, HEAD_DIM)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    work = gl.atomic_add(COUNTER, 1)
    done = 0  # tiles run by this program
    base = 0  # key tiles streamed by this program: the ring slots' count
    while work < n_work:
        rank, pid_bh = _program_tile(work, n_tiles, B * HQ, group_programs)
        m0 = (n_tiles - 1 - rank) * BLOCK_M  # last query blocks first: with causal they see the most keys
        h = pid_bh % HQ
        hk = h // (HQ // HKV)
        b = pid_bh // HQ
        # row r sees keys [0, row_end_r); the block keys [0, hi); tiles past full_end - BLOCK_N need the mask
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        if CAUSAL:
            row_end = gl.minimum(rows + shift + 1, S)
            hi = gl.maximum(gl.minimum(gl.minimum(m0 + BLOCK_M, T) + shift, S), 0)
            full_end = m0 + shift + 1
        else:
            row_end = gl.zeros_like(rows) + S
            hi = S
            full_end = S
        n_iter = gl.cdiv(hi, BLOCK_N)  # may be 0 (rows that see no key): dQ = 0 is still stored
        stat = (b.to(gl.int64) * HQ + h) * stat_pitch + rows
        lse2 = gl.load(LSE2 + stat, mask=rows < T, other=float("inf"))  # rows past T: p = 0
        delta = gl.load(DELTA + stat, mask=rows < T, other=0.0)

        mbarrier.expect(qd_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], qd_bar, q_smem.reshape([1, 1, BLOCK_M, HEAD_DIM]))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], qd_bar, do_smem.reshape([1, 1, BLOCK_M, HEAD_DIM]))
        for j in gl.static_range(NUM_BUF):
            _load_kv(k_desc, v_desc, k_smem, v_smem, ready, base + j, b, hk, j, j < n_iter)

        dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
        ds16 = gl.zeros([BLOCK_M, BLOCK_N], dtype, op_layout)  # the last dQ product's register operand
        mbarrier.wait(qd_bar, done & 1)
        for it in range(n_iter):
            g = base + it
            s = g % NUM_BUF
            mbarrier.wait(ready.index(s), (g // NUM_BUF) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, v_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # S done, and with it the last tile's dQ product (issued before): its ring slot is free again
            st, dq_r, ds16 = warpgroup_mma_wait(1, deps=(s_tok, dq, ds16))
            nxt = it - 1 + NUM_BUF
            _load_kv(k_desc, v_desc, k_smem, v_smem, ready, base + nxt, b, hk, nxt, (it > 0) & (nxt < n_iter))
            p = gl.exp2(st * qk_scale - lse2[:, None])
            if it * BLOCK_N + BLOCK_N > full_end:
                p = gl.where((it * BLOCK_N + cols0)[None, :] < row_end[:, None], p, 0.0)
            dp = warpgroup_mma_wait(0, deps=(dp_tok,))
            ds16 = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
            dq = warpgroup_mma(ds16, k_smem.index(s), dq_r, is_async=True)

        dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))
        out_rows = gl.convert_layout(rows, gl.SliceLayout(1, acc_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        out = (b.to(gl.int64) * stride_dqb + h * stride_dqh + out_rows.to(gl.int64)[:, None] * stride_dqt
               + out_cols[None, :])
        gl.store(DQ + out, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=(out_rows < T)[:, None])
        done += 1
        base += n_iter
        work = gl.atomic_add(COUNTER, 1)
    mbarrier.invalidate(qd_bar)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(i))
    # after the loop, outside any branch: scalar atomics in the loop's branches hit an illegal instruction or a
    # hang on the H100 (Triton 3.6; docs/perf/history.md)
    if gl.atomic_add(COUNTER + 1, 1) == gl.num_programs(0) - 1:
        gl.atomic_xchg(COUNTER, 0)
        gl.atomic_xchg(COUNTER + 1, 0)


def smem(config: triton.Config, head_dim: int, keys_resident: bool, dq_reduce: bool = False) -> int:
    """Shared memory of a config in bytes (16-bit elements): the resident tiles (k and v of the dK/dV
    kernel, ``keys_resident``, BLOCK_N rows; q and dO of the dQ kernel, BLOCK_M rows) and the ring of
    the streamed ones; with ``dq_reduce`` also the dS^T tile and the fp32 dQ staging slots."""
    kw = config.kwargs
    resident, streamed = (kw["BLOCK_N"], kw["BLOCK_M"]) if keys_resident else (kw["BLOCK_M"], kw["BLOCK_N"])
    staged = 2 * kw["BLOCK_N"] * kw["BLOCK_M"] + 4 * DQ_SLOTS.value * kw["BLOCK_M"] * DQ_CHUNK.value if dq_reduce else 0
    return 2 * head_dim * (2 * resident + 2 * kw["NUM_BUF"] * streamed) + staged


def _tuned(kernel, configs, keys_resident: bool, flags: tuple[str, ...] = (), dq_reduce: bool = False):
    """``kernel`` autotuned over ``configs`` ((BLOCK_M, BLOCK_N, num_warps, NUM_BUF, *values of the
    constexprs ``flags``) tuples), those whose tiles fit the shared memory (``device.smem_budget``: 227 KiB
    a block on an H100 or H200) kept; ``dq_reduce``: the dK/dV kernel's DQ_REDUCE variant, whose accumulator
    the autotuner zeroes before each timed run and before the real one (``reset_to_zero``)."""
    def prune(configs, named_args, **kwargs):
        d = {**named_args, **kwargs}["HEAD_DIM"]
        return [c for c in configs if smem(c, d, keys_resident, dq_reduce) <= smem_budget(0)] or configs[:1]

    return autotune([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "NUM_BUF": nb, **dict(zip(flags, rest))},
                                   num_warps=w, num_stages=1) for bm, bn, w, nb, *rest in configs],
                    key=["T_BUCKET", "S_BUCKET", "HEAD_DIM", "CAUSAL"],
                    prune_configs_by={"early_config_prune": prune},
                    **({"reset_to_zero": ["DQ_ACC"]} if dq_reduce else {}))(kernel)


_dkdv_kernel = _tuned(_sm90_dkdv_kernel, DKDV_CONFIGS, True, ("DV_WAIT",))
_dkdv_reduce_kernel = _tuned(_sm90_dkdv_kernel, DKDV_REDUCE_CONFIGS, True, ("DV_WAIT",), dq_reduce=True)
_dq_kernel = _tuned(_sm90_dq_kernel, DQ_CONFIGS, False)


def _head_rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """One batch entry of ``t`` [B, L, H, D] as a TMA matrix ``(rows, cols, head_rows, head_cols)`` whose
    block at (h * head_rows, h * head_cols) is head h's [L, D]: each token's heads side by side (stride(2)
    == D: [L, H * D], heads are column blocks) or each head's tokens in a row (stride(2) == L * stride(1),
    e.g. [B, H, L, D] storage: [H * L, D], heads are row blocks; a tile past row L reads the next head's
    rows, which the kernel weighs by 0). None: neither, or a base or row stride not 16-byte aligned."""
    B, L, H, D = t.shape
    if t.stride(3) != 1 or t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:3]):
        return None
    if t.stride(2) == D or H == 1:
        return L, H * D, 0, D
    if t.stride(2) == L * t.stride(1):
        return H * L, D, L, 0
    return None


def matrix_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, window, documents) -> tuple | None:
    """The runtime arguments both kernels take after their outputs' pointers, from q's and dO's TMA
    matrices (:func:`_head_rows`) to v's strides; None where the kernels do not apply: they need 16-bit
    inputs on an sm90 GPU, head dim 64 or 128, no window or documents, k and v with 16-byte aligned rows
    (what the Gluon forward needs: :func:`forward_sm90.supported`), q and dO in a layout of
    :func:`_head_rows`."""
    if not supported(q, k, v, window, documents):
        return None
    q_head, do_head = _head_rows(q), _head_rows(do)
    if q_head is None or do_head is None:
        return None
    return (q.stride(0), q.stride(1), *q_head, do.stride(0), do.stride(1), *do_head, *k.stride()[:3],
            *v.stride()[:3])


def launch_dkdv(q, k, v, do, lse2, delta, dk, dv, args: tuple, causal: bool, scale: float, qk_scale: float,
                group_programs: int, key, dq_acc: torch.Tensor | None = None) -> None:
    """dK and dV into ``dk`` and ``dv`` [B, S, Hkv, D] (equal strides) from the preprocess kernel's ``lse2``
    and ``delta`` [B, Hq, pitch]; ``args``: :func:`matrix_args` of the inputs; ``key`` determines the
    shapes, strides and flags (the launch plan's key, see :meth:`launch._Autotuned.launch`). With ``dq_acc``
    (zeroed, [B, Hq, T, D] fp32, contiguous) the DQ_REDUCE kernel also adds dQ / scale into it."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    grid = lambda meta: (triton.cdiv(S, meta["BLOCK_N"]) * B * Hkv,)  # noqa: E731
    triton.set_allocator(tma_scratch)  # the in-kernel descriptors' scratch; per call: the allocator is per thread
    kernel = _dkdv_kernel if dq_acc is None else _dkdv_reduce_kernel
    kernel.launch(key, grid, q, k, v, do, lse2, delta, dk, dv, dk if dq_acc is None else dq_acc, *args,
                  *dk.stride()[:3], T, S, Hq, Hkv, lse2.shape[-1], S - T, qk_scale, scale, group_programs,
                  next_pow2(T), next_pow2(S), HEAD_DIM=D, CAUSAL=causal, DQ_REDUCE=dq_acc is not None)


def launch_dq(q, k, v, do, lse2, delta, dq, args: tuple, causal: bool, scale: float, qk_scale: float,
              group_programs: int, key) -> None:
    """dQ into ``dq`` [B, T, Hq, D]; the rest as :func:`launch_dkdv`. DQ_PROGRAMS_PER_SM programs an SM (fewer
    where there are fewer query tiles)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    grid = lambda meta: (min(triton.cdiv(T, meta["BLOCK_M"]) * B * Hq, DQ_PROGRAMS_PER_SM * num_sms(q.device.index)),)  # noqa: E731
    triton.set_allocator(tma_scratch)
    _dq_kernel.launch(key, grid, q, k, v, do, lse2, delta, dq, *args, *dq.stride()[:3],
                      T, S, Hq, Hkv, lse2.shape[-1], S - T, qk_scale, scale, group_programs, B, tile_counter(),
                      next_pow2(T), next_pow2(S), HEAD_DIM=D, CAUSAL=causal)
