"""A warp-specialized GEMM for Hopper (sm90), written in Gluon: the plain and residual products of
:func:`gemm.gemm` with 16-bit tensor-descriptor operands, and the scaled products of fp8 operands (both
K-major, as Hopper's fp8 wgmma takes them: ``c = a_scale[m] b_scale[n] (a @ b) (+ residual)``, the wgmma's
limited-precision sums promoted to fp32 every BLOCK_K), behind ``GemmSettings.sm90_ws`` (on by default).

One producer warp (``_load_partition``, few registers) streams the A and B tiles of every output tile
the program owns through a STAGES-deep ring in shared memory (TMA, an mbarrier per slot each way);
the consumers run the wgmma chain with one product in flight, hand each slot back when the product
that read it is done, and write the tile through a TMA store. Two schedules (``PINGPONG``, a config
field): cooperative, two warpgroups splitting a 128-row tile between them (the producer runs ahead into
the next tile while they finish this one's epilogue); ping-pong, two warpgroups taking the program's
tiles in turn, one's products running while the other's epilogue does (cuBLAS ships both kinds). The
single-stream kernel of gemm.py (``GemmSettings.flatten``) overlaps the epilogue only as far as its software
pipeline reaches.

Same layouts as gemm._matmul_kernel: A [M, K] K- or M-contiguous, B [K, N] N- or K-contiguous (x W^T,
dY W and dY^T x without copies); the same tile order (grouped M, :func:`gemm_tiles.tile_coords`) and grid
(min(#SMs, tiles) programs, or one per tile with ``GemmSettings.persistent`` off). The producer picks each
of the program's tiles and hands its index to the consumers through shared memory: every P-th tile, or
with ``GemmSettings.dynamic`` (a persistent grid) the next one no program has taken, from a global counter
(:func:`scratch.tile_counter`) that the last program to finish sets back to zero. fp32 accumulation.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gemm_tiles import PLAIN, tile_coords

#: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PINGPONG) the autotuner tries; one producer warp beside the consumers.
#: PINGPONG False: one consumer partition of 8 warps (two warpgroups splitting each tile's rows); True: two
#: consumer warpgroups taking the program's tiles in turn, each with its own c_smem slot (cuBLAS's ping-pong
#: kernels), so that one's epilogue overlaps the other's products
CONFIGS = [(128, 256, 64, 3, False), (128, 128, 64, 4, False), (128, 128, 64, 5, False), (128, 128, 64, 4, True),
           (128, 128, 64, 3, True), (64, 256, 64, 4, True)]
#: the same for the gated (SwiGLU) forward: two accumulators (gate, up) of BLOCK_M x BLOCK_N each and
#: a B ring twice as deep (4 stages of 128 x 128: 224 KiB with c_smem)
GATED_CONFIGS = [(128, 128, 64, 3, False), (128, 128, 64, 4, False), (64, 128, 64, 4, True), (64, 128, 64, 3, True)]
#: the same for fp8 operands: a BLOCK_K of 128 or 256 one-byte elements, the promotion interval (the wgmma's
#: limited-precision sums go into the fp32 tile once per K step, and the compiler waits for each step's products
#: before it adds them, ptxas C7517: 256 halves those waits); 128 x 128 tiles, since the promotion keeps a second
#: fp32 accumulator in registers (128 x 256 spills, 464 bytes a thread)
FP8_CONFIGS = [(128, 128, 128, 4, False), (128, 128, 128, 5, False), (128, 128, 128, 4, True),
               (128, 128, 128, 3, True), (64, 128, 128, 5, True), (128, 128, 256, 3, False), (128, 128, 256, 2, True)]
#: registers per thread of the producer warp (setmaxnreg; the consumers get what is left)
LOAD_REGS = gl.constexpr(40)
#: slots of the ring through which the producer hands tile indices to the consumers: how many tiles it
#: may run ahead (with few K steps a tile, more than the operand ring's depth)
ID_SLOTS = gl.constexpr(4)

_tile_coords = gluon.jit(tile_coords.fn)


@gluon.jit
def _next_tile(counter_ptr, tile, DYNAMIC: gl.constexpr):
    """The program's next output tile: DYNAMIC, the next one nobody has taken (a global counter);
    otherwise the static stride, ``tile + P`` (the first: ``program_id - P``)."""
    if DYNAMIC:
        return gl.atomic_add(counter_ptr, 1)
    else:
        return tile + gl.num_programs(0)


@gluon.jit
def _publish(ids, id_ready, id_empty, seq, tile):
    """Hand the program's seq-th tile index to the consumer that takes it, through slot seq % ID_SLOTS of ``ids``."""
    slot = seq % ID_SLOTS
    mbarrier.wait(id_empty.index(slot), ((seq // ID_SLOTS) & 1) ^ 1)  # a slot starts free
    ids.index(slot).store(gl.full([1], tile, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))
    gl.thread_barrier()
    mbarrier.arrive(id_ready.index(slot), count=1)


@gluon.jit
def _take(ids, id_ready, id_empty, seq):
    """The program's seq-th tile index (:func:`_publish`); the slot goes back at once."""
    slot = seq % ID_SLOTS
    mbarrier.wait(id_ready.index(slot), (seq // ID_SLOTS) & 1)
    tile = gl.max(ids.index(slot).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), axis=0)
    gl.thread_barrier()  # every warp has read it
    mbarrier.arrive(id_empty.index(slot), count=1)
    return tile


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, ids, id_ready, id_empty, counter_ptr, M, N, K,
                    A_K_CONTIGUOUS: gl.constexpr, B_N_CONTIGUOUS: gl.constexpr, GROUP_M: gl.constexpr,
                    CONSUMERS: gl.constexpr, DYNAMIC: gl.constexpr, GATED: gl.constexpr):
    """The producer: picks the program's tiles (:func:`_next_tile`), hands each one's index to the
    consumers, and streams its A and B blocks through the ring (GATED: B's gate block into slot s of
    ``b_bufs`` and its up block, N columns further, into slot STAGES + s); past the last tile, an index
    past the end to each consumer. DYNAMIC: the last program to finish returns the counters to zero for
    the next launch on the stream (every program has taken its last index by then)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2] if A_K_CONTIGUOUS else a_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1] if A_K_CONTIGUOUS else a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_N_CONTIGUOUS else b_bufs.type.shape[1]
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    it = 0
    seq = 0
    tile = _next_tile(counter_ptr, gl.program_id(0) - gl.num_programs(0), DYNAMIC)
    while tile < num_tiles:
        _publish(ids, id_ready, id_empty, seq, tile)
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        for ki in range(k_steps):
            s = it % STAGES
            # a slot starts free: its first wait (phase 1) passes at once
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes * (2 if GATED else 1))
            k0 = ki * BLOCK_K
            if A_K_CONTIGUOUS:
                tma.async_copy_global_to_shared(a_desc, [m0, k0], ready.index(s), a_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(a_desc, [k0, m0], ready.index(s), a_bufs.index(s))
            if B_N_CONTIGUOUS:
                tma.async_copy_global_to_shared(b_desc, [k0, n0], ready.index(s), b_bufs.index(s))
                if GATED:
                    tma.async_copy_global_to_shared(b_desc, [k0, N + n0], ready.index(s), b_bufs.index(STAGES + s))
            else:
                tma.async_copy_global_to_shared(b_desc, [n0, k0], ready.index(s), b_bufs.index(s))
                if GATED:
                    tma.async_copy_global_to_shared(b_desc, [N + n0, k0], ready.index(s), b_bufs.index(STAGES + s))
            it += 1
        seq += 1
        tile = _next_tile(counter_ptr, tile, DYNAMIC)
    for c in gl.static_range(CONSUMERS):
        _publish(ids, id_ready, id_empty, seq + c, num_tiles)
    if DYNAMIC:
        if gl.atomic_add(counter_ptr + 1, 1) == gl.num_programs(0) - 1:
            gl.atomic_xchg(counter_ptr, 0)
            gl.atomic_xchg(counter_ptr + 1, 0)


@gluon.jit
def _slot(bufs, s, AS_STORED: gl.constexpr):
    """Ring slot s as the product takes it (A [BLOCK_M, BLOCK_K], B [BLOCK_K, BLOCK_N]): as stored, or
    transposed when the operand's other dim is the contiguous one."""
    if AS_STORED:
        return bufs.index(s)
    else:
        return bufs.index(s).permute((1, 0))


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, it, k_steps, acc_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              A_K_CONTIGUOUS: gl.constexpr, B_N_CONTIGUOUS: gl.constexpr, GATED: gl.constexpr, FP8: gl.constexpr):
    """One output tile's products over the ring slots of iterations it .. it + k_steps, one K step's
    products in flight, each slot handed back once the products that read it are done; the fp32 tile,
    twice (GATED: the gate tile, then the up tile from the slots STAGES further on in ``b_bufs``). FP8: the
    wgmma's limited-precision sums are added into the fp32 tile once per K step (BLOCK_K products)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1] if A_K_CONTIGUOUS else a_bufs.type.shape[2]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2] if A_K_CONTIGUOUS else a_bufs.type.shape[1]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for ki in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = _slot(a_bufs, s, A_K_CONTIGUOUS)
        if FP8:
            acc = warpgroup_mma(a, _slot(b_bufs, s, B_N_CONTIGUOUS), acc, is_async=True,
                                max_num_imprecise_acc=BLOCK_K)
        else:
            acc = warpgroup_mma(a, _slot(b_bufs, s, B_N_CONTIGUOUS), acc, is_async=True)
        # one K step in flight: the step before it is done, so its slot goes back to the producer
        if GATED:
            acc_up = warpgroup_mma(a, _slot(b_bufs, STAGES + s, B_N_CONTIGUOUS), acc_up, is_async=True)
            acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ki > 0)
        it += 1
    if GATED:
        acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    return acc, acc_up


@gluon.jit
def _store_tile(x, desc, c_smem, m0, n0):
    """``x`` at (m0, n0) of ``desc`` through ``c_smem`` and a TMA store, once the last store from
    ``c_smem`` has read it."""
    tma.store_wait(0)
    c_smem.store(x.to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [m0, n0], c_smem)


@gluon.jit
def _epilogue(acc, acc_up, descs, c_smem, e_ptr, scale_ptrs, m0, n0, M, N, stride_em, stride_en,
              HAS_RESIDUAL: gl.constexpr, GATED: gl.constexpr, STORE_GU: gl.constexpr, SCALED: gl.constexpr):
    """The tile (SCALED: times A's row scales and B's column scales, ``scale_ptrs``; plus the residual) into
    C; GATED: silu(gate) * up into C, and with STORE_GU the gate and up tiles into their halves of gu first.
    ``descs``: C's, gu's gate half's and up half's."""
    c_desc, g_desc, u_desc = descs
    if SCALED:
        sa_ptr, sb_ptr = scale_ptrs
        rows = m0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
        cols = n0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        sa = gl.load(sa_ptr + rows, mask=rows < M, other=0.0)
        sb = gl.load(sb_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if GATED:
        if STORE_GU:
            _store_tile(acc, g_desc, c_smem, m0, n0)
            _store_tile(acc_up, u_desc, c_smem, m0, n0)
        acc = acc / (1.0 + gl.exp(-acc)) * acc_up
    if HAS_RESIDUAL:
        rows = m0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
        cols = n0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        e = gl.load(e_ptr + rows.to(gl.int64)[:, None] * stride_em + cols.to(gl.int64)[None, :] * stride_en,
                    mask=(rows < M)[:, None] & (cols < N)[None, :], other=0.0)
        acc = acc + e.to(gl.float32)
    _store_tile(acc, c_desc, c_smem, m0, n0)


@gluon.jit
def _mma_partition(problem, C: gl.constexpr, CONSUMERS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                   A_K_CONTIGUOUS: gl.constexpr, B_N_CONTIGUOUS: gl.constexpr, GROUP_M: gl.constexpr,
                   GATED: gl.constexpr, STORE_GU: gl.constexpr, SCALED: gl.constexpr):
    """Consumer C of CONSUMERS. One (cooperative: its warpgroups split each tile's rows): every tile of
    the program. Two (ping-pong, a warpgroup each): the program's tiles C, C + 2, ... of the sequence
    the producer hands out (:func:`_take`), in its own c_smem slot; each runs a tile's products on its
    turn (``turn[C]``, consumer 0 first) and hands the turn over before its epilogue, so that one's
    epilogue runs while the other's products do."""
    a_bufs, b_bufs, ready, empty, turn, ids, id_ready, id_empty, descs, c_smem, e_ptr, scale_ptrs, M, N, K, \
        stride_em, stride_en = problem
    BLOCK_M: gl.constexpr = c_smem.type.shape[1]
    BLOCK_N: gl.constexpr = c_smem.type.shape[2]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2] if A_K_CONTIGUOUS else a_bufs.type.shape[1]
    FP8: gl.constexpr = a_bufs.dtype.primitive_bitwidth == 8
    # the wgmma instruction's K: 32 bytes of operand (16 bf16, 32 fp8)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 32 if FP8 else 16])
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    seq = C  # the tile's place in the program's sequence, which the producer loads in order
    tile = _take(ids, id_ready, id_empty, seq)
    while tile < num_pid_m * num_pid_n:
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        if CONSUMERS > 1:
            mbarrier.wait(turn.index(C), ((seq // CONSUMERS) & 1) ^ (1 - C))
        acc, acc_up = _mainloop(a_bufs, b_bufs, ready, empty, seq * k_steps, k_steps, acc_layout, BLOCK_N,
                                A_K_CONTIGUOUS, B_N_CONTIGUOUS, GATED, FP8)
        if CONSUMERS > 1:
            mbarrier.arrive(turn.index(1 - C), count=1)
        _epilogue(acc, acc_up, descs, c_smem.index(C), e_ptr, scale_ptrs, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                  stride_em, stride_en, HAS_RESIDUAL, GATED, STORE_GU, SCALED)
        seq += CONSUMERS
        tile = _take(ids, id_ready, id_empty, seq)
    tma.store_wait(0)


@gluon.jit
def _operand(ptr, rows, cols, stride, BLOCK_ROWS: gl.constexpr, BLOCK_COLS: gl.constexpr, STAGES: gl.constexpr):
    """The tensor descriptor of a [rows, cols] operand with a unit column stride, and a STAGES-deep
    ring of [BLOCK_ROWS, BLOCK_COLS] tiles for it in shared memory (128-byte swizzle, 16- or 8-bit)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                element_bitwidth=ptr.dtype.element_ty.primitive_bitwidth, rank=2)
    desc = tma.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[stride, 1],
                                      block_shape=[BLOCK_ROWS, BLOCK_COLS], layout=layout)
    return desc, gl.allocate_shared_memory(ptr.dtype.element_ty, [STAGES, BLOCK_ROWS, BLOCK_COLS], layout)


@gluon.jit
def ws_matmul_kernel(
    a_ptr, b_ptr, c_ptr, gu_ptr, bias_ptr, e_ptr, sa_ptr, sb_ptr,  # gemm._matmul_kernel's arguments, in its order
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn, stride_gm, stride_em, stride_en,
    counter_ptr,  # DYNAMIC: int32 [2], zeros (the next tile to hand out, the programs done; zero again at the end)
    EPILOGUE: gl.constexpr, STORE_GU: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
    A_K_CONTIGUOUS: gl.constexpr, B_N_CONTIGUOUS: gl.constexpr, SCALED: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr = False,
):
    if A_K_CONTIGUOUS:
        a_desc, a_bufs = _operand(a_ptr, M, K, stride_am, BLOCK_M, BLOCK_K, STAGES)
    else:
        a_desc, a_bufs = _operand(a_ptr, K, M, stride_ak, BLOCK_K, BLOCK_M, STAGES)
    GATED: gl.constexpr = EPILOGUE != 0  # gemm.SWIGLU_FWD: B [K, 2N], gate columns then up columns
    B_SLOTS: gl.constexpr = 2 * STAGES if GATED else STAGES
    if B_N_CONTIGUOUS:
        b_desc, b_bufs = _operand(b_ptr, K, 2 * N if GATED else N, stride_bk, BLOCK_K, BLOCK_N, B_SLOTS)
    else:
        b_desc, b_bufs = _operand(b_ptr, 2 * N if GATED else N, K, stride_bn, BLOCK_N, BLOCK_K, B_SLOTS)
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    c_desc = tma.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                        block_shape=[BLOCK_M, BLOCK_N], layout=layout)
    if STORE_GU:  # gu [M, 2N]: the gate half and the up half, each clipped at its N columns
        descs = (c_desc,
                 tma.make_tensor_descriptor(gu_ptr, shape=[M, N], strides=[stride_gm, 1],
                                            block_shape=[BLOCK_M, BLOCK_N], layout=layout),
                 tma.make_tensor_descriptor(gu_ptr + N, shape=[M, N], strides=[stride_gm, 1],
                                            block_shape=[BLOCK_M, BLOCK_N], layout=layout))
    else:
        descs = (c_desc, c_desc, c_desc)
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [CONSUMERS, BLOCK_M, BLOCK_N], layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ids = gl.allocate_shared_memory(gl.int32, [ID_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    id_ready = gl.allocate_shared_memory(gl.int64, [ID_SLOTS, 1], mbarrier.MBarrierLayout())
    id_empty = gl.allocate_shared_memory(gl.int64, [ID_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if PINGPONG:  # unused otherwise: no mbarrier left initialized in memory the compiler may reuse
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(ID_SLOTS):
        mbarrier.init(id_ready.index(i), count=1)
        mbarrier.init(id_empty.index(i), count=1)
    problem = (a_bufs, b_bufs, ready, empty, turn, ids, id_ready, id_empty, descs, c_smem, e_ptr, (sa_ptr, sb_ptr),
               M, N, K, stride_em, stride_en)
    FIRST: gl.constexpr = 0  # consumer indices as constexprs (a literal in the partitions' arguments is not one)
    SECOND: gl.constexpr = 1
    if PINGPONG:
        gl.warp_specialize([
            (_mma_partition, (problem, FIRST, CONSUMERS, HAS_RESIDUAL, A_K_CONTIGUOUS, B_N_CONTIGUOUS, GROUP_M, GATED,
                               STORE_GU, SCALED)),
            (_mma_partition, (problem, SECOND, CONSUMERS, HAS_RESIDUAL, A_K_CONTIGUOUS, B_N_CONTIGUOUS, GROUP_M, GATED,
                               STORE_GU, SCALED)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ids, id_ready, id_empty, counter_ptr, M,
                               N, K, A_K_CONTIGUOUS, B_N_CONTIGUOUS, GROUP_M, CONSUMERS, DYNAMIC, GATED))],
            [4, 1], [232, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (problem, FIRST, CONSUMERS, HAS_RESIDUAL, A_K_CONTIGUOUS, B_N_CONTIGUOUS, GROUP_M, GATED,
                               STORE_GU, SCALED)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ids, id_ready, id_empty, counter_ptr, M,
                               N, K, A_K_CONTIGUOUS, B_N_CONTIGUOUS, GROUP_M, CONSUMERS, DYNAMIC, GATED))],
            [1], [LOAD_REGS])


def applies(args: dict, a_dtype, c_dtype) -> bool:
    """This kernel computes the problem gemm planned as ``args`` (gemm._gemm_plan's): the PLAIN epilogue
    with at most a residual, or SWIGLU_FWD (with or without gu), no split along K, output through tensor
    descriptors; 16-bit operands of the output's dtype, or scaled fp8 operands (PLAIN, both K-major) with
    a 16-bit output."""
    if args["FP8"]:
        operands = (args["SCALED"] and args["EPILOGUE"] == PLAIN and args["A_K_CONTIGUOUS"]
                    and not args["B_N_CONTIGUOUS"] and c_dtype.itemsize == 2)
    else:
        operands = not args["SCALED"] and a_dtype == c_dtype and a_dtype.itemsize == 2
    return (operands and not (args["HAS_BIAS"] or args["ACCUMULATE"])
            and (args["EPILOGUE"] == PLAIN or not args["HAS_RESIDUAL"])
            and args["SPLIT_K"] == 1 and args["USE_TMA"] and args["TMA_STORE"] and args["K"] > 0
            and (not args["STORE_GU"] or args["gu_ptr"].dtype == c_dtype))  # gu goes out through c_smem


def configs(gated: bool = False, fp8: bool = False) -> list[triton.Config]:
    """:data:`CONFIGS` (``gated``: :data:`GATED_CONFIGS`; ``fp8``: :data:`FP8_CONFIGS`) as autotuner configs
    (num_warps: the first consumer partition's; the second consumer warpgroup of a ping-pong config and
    the producer warp come on top)."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "STAGES": st, "GROUP_M": 8, "PINGPONG": pp},
                          num_warps=4 if pp else 8, num_stages=1)
            for bm, bn, bk, st, pp in (GATED_CONFIGS if gated else FP8_CONFIGS if fp8 else CONFIGS)]


#: the flags of gemm._gemm_plan's arguments that this kernel takes
FLAG_ARGS = ("EPILOGUE", "STORE_GU", "HAS_RESIDUAL", "A_K_CONTIGUOUS", "B_N_CONTIGUOUS", "SCALED")
_TUNE_KEY = ["M", "N", "K", *FLAG_ARGS, "DYNAMIC"]
ws_matmul_kernel_tuned = triton.autotune(configs=configs(), key=_TUNE_KEY)(ws_matmul_kernel)
ws_gated_kernel_tuned = triton.autotune(configs=configs(gated=True), key=_TUNE_KEY)(ws_matmul_kernel)
ws_fp8_kernel_tuned = triton.autotune(configs=configs(fp8=True), key=_TUNE_KEY)(ws_matmul_kernel)


def tuned(args: dict):
    """The autotuner of ``args``'s problem (gemm._gemm_plan's): gated (SwiGLU), fp8, or plain 16-bit."""
    if args["EPILOGUE"] != PLAIN:
        return ws_gated_kernel_tuned
    return ws_fp8_kernel_tuned if args["FP8"] else ws_matmul_kernel_tuned
