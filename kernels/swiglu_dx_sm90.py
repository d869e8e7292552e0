"""linear_swiglu's backward to its input in one warp-specialized Hopper kernel (Gluon), behind
``kernels.linear.FUSED_SWIGLU_BWD`` (off until timed on a GPU; design and prediction in docs/perf/NOTES.md).

With the knob on, the forward saves the backward's factors fa = silu(g) and fb = up * silu'(g) instead of g and
up (gemm.SWIGLU_FWD_FACTORS: the same bytes), so the backward's elementwise math is two products. This kernel
computes dx = dgu @ w13 with dgu = [dh * fb, dh * fa] made on the way and written out for dw13 = dgu^T x:

- a producer warp streams dh, fa and fb tiles [BLOCK_M, BLOCK_K] (one ring) and W1, W3 tiles [BLOCK_K, BLOCK_N]
  (another) by TMA;
- the two consumer warpgroups (the default partition, 64 rows each) turn a K step's dh, fa, fb into dgate, dup,
  write them once into shared memory, issue that step's two products (A and B from shared memory) and make
  the next step's operands while they run (FlashAttention-3's intra-warpgroup overlap); the column tile with
  ``pid_n == ki % num_pid_n`` also stores block ki of dgu by TMA, so a row block's dgu is written once, its
  stores spread over the column tiles; then the tile of dx through the W ring's memory.

A ``tl`` version with g and up (the sigmoid recomputed per column tile) ran 1.8x slower than the two passes it
replaces, and a three-partition Gluon draft padded to 16 warps with 128 registers a thread (NOTES.md): hence
the factors and the math in the MMA warpgroups (8 + 1 warps pad to 12; 168 registers, no spills, offline).

One program per output tile in grouped-M order (:func:`gemm.tile_coords`); fp32 accumulation; deterministic.
dh [M, F], factors [M, 2F], dgu [M, 2F], dx [M, N] with a unit column stride, w13 [2F, N] N-contiguous, 16-bit,
16-byte aligned bases and row strides, F * 2 bytes too (:func:`applies`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import gemm
from ._common import Launch, Plans, hopper, tma_scratch

#: (BLOCK_M, BLOCK_N, BLOCK_K, IN_STAGES, W_STAGES, A_STAGES): the depths of the dh/fa/fb, W1/W3 and dgate/dup
#: rings; dx's tile reuses the W ring. 180,484 bytes of shared memory at 128x256 (offline sm_90 compile), the
#: second for N <= 128.
CONFIGS = [(128, 256, 32, 2, 3, 2), (128, 128, 32, 2, 3, 2)]
#: registers per thread of the producer warp (the consumers get what is left)
LOAD_REGS = gl.constexpr(40)
_tile_coords = gluon.jit(gemm.tile_coords.fn)


@gluon.jit
def _load_partition(h_desc, fa_desc, fb_desc, w1_desc, w3_desc, in_bufs, w_bufs, in_ready, in_empty, w_ready,
                    w_empty, m0, n0, k_steps):
    """The producer: K step ki's dh, fa, fb tiles into slots 3s, 3s + 1, 3s + 2 of ``in_bufs`` (s = ki mod
    IN_STAGES), its W1, W3 tiles into slots 2t, 2t + 1 of ``w_bufs`` (t = ki mod W_STAGES); a ready and an empty
    mbarrier per stage of each ring (an empty slot's first wait passes at once)."""
    IN_STAGES: gl.constexpr = in_bufs.type.shape[0] // 3
    W_STAGES: gl.constexpr = w_bufs.type.shape[0] // 2
    BLOCK_K: gl.constexpr = in_bufs.type.shape[2]
    for ki in range(k_steps):
        k0 = ki * BLOCK_K
        s = ki % IN_STAGES
        mbarrier.wait(in_empty.index(s), ((ki // IN_STAGES) & 1) ^ 1)
        mbarrier.expect(in_ready.index(s), 3 * h_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(h_desc, [m0, k0], in_ready.index(s), in_bufs.index(3 * s))
        tma.async_copy_global_to_shared(fa_desc, [m0, k0], in_ready.index(s), in_bufs.index(3 * s + 1))
        tma.async_copy_global_to_shared(fb_desc, [m0, k0], in_ready.index(s), in_bufs.index(3 * s + 2))
        t = ki % W_STAGES
        mbarrier.wait(w_empty.index(t), ((ki // W_STAGES) & 1) ^ 1)
        mbarrier.expect(w_ready.index(t), 2 * w1_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w1_desc, [k0, n0], w_ready.index(t), w_bufs.index(2 * t))
        tma.async_copy_global_to_shared(w3_desc, [k0, n0], w_ready.index(t), w_bufs.index(2 * t + 1))


@gluon.jit
def _compute_partition(in_bufs, w_bufs, a_bufs, in_ready, in_empty, w_ready, w_empty, dg_desc, du_desc, x_desc, m0,
                       n0, pid_n, num_pid_n, k_steps):
    """The consumer warpgroups: per K step, dgate = dh * fb and dup = dh * fa (fp32, rounded) into slots 2t,
    2t + 1 of ``a_bufs`` (t = ki mod A_STAGES; the products that read the slot A_STAGES steps ago are done, and
    so is its dgu store), block ki of dgu out by TMA when ki mod num_pid_n == pid_n, then acc += dgate @ W1 +
    dup @ W3 with this step's two products in flight while the next step's operands are made; the W slot of
    the step before goes back once its products are done. Then dx's tile through the W ring's memory."""
    IN_STAGES: gl.constexpr = in_bufs.type.shape[0] // 3
    W_STAGES: gl.constexpr = w_bufs.type.shape[0] // 2
    A_STAGES: gl.constexpr = a_bufs.type.shape[0] // 2
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[2]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for ki in range(k_steps):
        s = ki % IN_STAGES
        mbarrier.wait(in_ready.index(s), (ki // IN_STAGES) & 1)
        dh = in_bufs.index(3 * s).load(layout)
        fa = in_bufs.index(3 * s + 1).load(layout)
        fb = in_bufs.index(3 * s + 2).load(layout)
        gl.thread_barrier()  # every warp has read the slot
        mbarrier.arrive(in_empty.index(s), count=1)
        dhf = dh.to(gl.float32)
        dg = (dhf * fb.to(gl.float32)).to(a_bufs.dtype)
        du = (dhf * fa.to(gl.float32)).to(a_bufs.dtype)
        t = ki % A_STAGES
        tma.store_wait(0)  # the dgu stores of the slot's last use have read it
        gl.thread_barrier()
        a_bufs.index(2 * t).store(dg)
        a_bufs.index(2 * t + 1).store(du)
        fence_async_shared()
        gl.thread_barrier()  # every warp's rows are written before the products or the stores read them
        if ki % num_pid_n == pid_n:
            tma.async_copy_shared_to_global(dg_desc, [m0, ki * BLOCK_K], a_bufs.index(2 * t))
            tma.async_copy_shared_to_global(du_desc, [m0, ki * BLOCK_K], a_bufs.index(2 * t + 1))
        w = ki % W_STAGES
        mbarrier.wait(w_ready.index(w), (ki // W_STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(2 * t), w_bufs.index(2 * w), acc, is_async=True)
        acc = warpgroup_mma(a_bufs.index(2 * t + 1), w_bufs.index(2 * w + 1), acc, is_async=True)
        acc = warpgroup_mma_wait(2, deps=(acc,))  # the step before is done: its W slot goes back
        mbarrier.arrive(w_empty.index((ki + W_STAGES - 1) % W_STAGES), count=1, pred=ki > 0)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    tma.store_wait(0)
    # no load is left in flight into the W ring: dx's tile goes out through its memory
    c_smem = w_bufs._reinterpret(x_desc.dtype, [BLOCK_M, BLOCK_N], x_desc.layout)
    c_smem.store(acc.to(x_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(x_desc, [m0, n0], c_smem)
    tma.store_wait(0)


@gluon.jit
def swiglu_dx_kernel(dh_ptr, f_ptr, w_ptr, dx_ptr, dgu_ptr, M, N, F, stride_hm, stride_fm, stride_wk, stride_xm,
                     stride_dm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     IN_STAGES: gl.constexpr, W_STAGES: gl.constexpr, A_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of dx = dgu @ w13 (the module docstring; dh [M, F], factors f [M, 2F], w13
    [2F, N] with row stride stride_wk, dx [M, N], dgu [M, 2F] out)."""
    dtype: gl.constexpr = dh_ptr.dtype.element_ty
    in_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    h_desc = tma.make_tensor_descriptor(dh_ptr, shape=[M, F], strides=[stride_hm, 1], block_shape=[BLOCK_M, BLOCK_K],
                                        layout=in_layout)
    fa_desc = tma.make_tensor_descriptor(f_ptr, shape=[M, F], strides=[stride_fm, 1], block_shape=[BLOCK_M, BLOCK_K],
                                         layout=in_layout)
    fb_desc = tma.make_tensor_descriptor(f_ptr + F, shape=[M, F], strides=[stride_fm, 1],
                                         block_shape=[BLOCK_M, BLOCK_K], layout=in_layout)
    dg_desc = tma.make_tensor_descriptor(dgu_ptr, shape=[M, F], strides=[stride_dm, 1],
                                         block_shape=[BLOCK_M, BLOCK_K], layout=in_layout)
    du_desc = tma.make_tensor_descriptor(dgu_ptr + F, shape=[M, F], strides=[stride_dm, 1],
                                         block_shape=[BLOCK_M, BLOCK_K], layout=in_layout)
    # W1 and W3 as [F, N] each: a block never reads across the gate/up boundary (TMA zero-fills past F)
    w1_desc = tma.make_tensor_descriptor(w_ptr, shape=[F, N], strides=[stride_wk, 1], block_shape=[BLOCK_K, BLOCK_N],
                                         layout=w_layout)
    w3_desc = tma.make_tensor_descriptor(w_ptr + F * stride_wk, shape=[F, N], strides=[stride_wk, 1],
                                         block_shape=[BLOCK_K, BLOCK_N], layout=w_layout)
    x_desc = tma.make_tensor_descriptor(dx_ptr, shape=[M, N], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_N],
                                        layout=x_layout)
    in_bufs = gl.allocate_shared_memory(dtype, [3 * IN_STAGES, BLOCK_M, BLOCK_K], in_layout)
    w_bufs = gl.allocate_shared_memory(dtype, [2 * W_STAGES, BLOCK_K, BLOCK_N], w_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [2 * A_STAGES, BLOCK_M, BLOCK_K], in_layout)
    in_ready = gl.allocate_shared_memory(gl.int64, [IN_STAGES, 1], mbarrier.MBarrierLayout())
    in_empty = gl.allocate_shared_memory(gl.int64, [IN_STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(IN_STAGES):
        mbarrier.init(in_ready.index(i), count=1)
        mbarrier.init(in_empty.index(i), count=1)
    for i in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(gl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    k_steps = gl.cdiv(F, BLOCK_K)
    gl.warp_specialize([
        (_compute_partition, (in_bufs, w_bufs, a_bufs, in_ready, in_empty, w_ready, w_empty, dg_desc, du_desc, x_desc,
                              m0, n0, pid_n, num_pid_n, k_steps)),
        (_load_partition, (h_desc, fa_desc, fb_desc, w1_desc, w3_desc, in_bufs, w_bufs, in_ready, in_empty, w_ready,
                           w_empty, m0, n0, k_steps))],
        [1], [LOAD_REGS])


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def applies(dh: torch.Tensor, factors: torch.Tensor, w13: torch.Tensor, dx: torch.Tensor, dgu: torch.Tensor) -> bool:
    """This kernel takes the problem: a Hopper GPU, 16-bit operands of one dtype, unit column strides (w13
    N-contiguous), 16-byte aligned bases and row strides, F > 0 columns of a 16-byte multiple, N > 0."""
    tensors = (dh, factors, w13, dx, dgu)
    return (dh.is_cuda and hopper(dh.device) and dh.element_size() == 2
            and all(t.dtype == dh.dtype for t in tensors) and all(_aligned(t) for t in tensors)
            and dh.shape[1] > 0 and dx.shape[1] > 0 and (dh.shape[1] * dh.element_size()) % 16 == 0)


#: launch plans per problem (shapes, strides, dtype, device)
_PLANS = Plans()


def swiglu_dx(dh: torch.Tensor, factors: torch.Tensor, w13: torch.Tensor, dx: torch.Tensor,
              dgu: torch.Tensor) -> torch.Tensor:
    """``dx = dgu @ w13`` (dx [M, N], written and returned) with ``dgu = [dh * fb, dh * fa]`` [M, 2F] written into
    ``dgu``, from dh [M, F] and the forward's factors [M, 2F] = [fa, fb]; w13 [2F, N]. Needs :func:`applies`."""
    M, F = dh.shape
    N = dx.shape[1]
    key = (dh.shape, dh.stride(), factors.stride(), w13.shape, w13.stride(), dx.stride(), dgu.stride(), dh.dtype,
           dh.device)
    plan = _PLANS.get(key)
    if plan is None:
        bm, bn, bk, in_stages, w_stages, a_stages = CONFIGS[1] if N <= 128 else CONFIGS[0]
        plan = _PLANS.add(key, Launch(swiglu_dx_kernel, (triton.cdiv(M, bm) * triton.cdiv(N, bn),), BLOCK_M=bm,
                                      BLOCK_N=bn, BLOCK_K=bk, IN_STAGES=in_stages, W_STAGES=w_stages,
                                      A_STAGES=a_stages, GROUP_M=8, num_warps=8))
    triton.set_allocator(tma_scratch)
    plan(dh, factors, w13, dx, dgu, M, N, F, dh.stride(0), factors.stride(0), w13.stride(0), dx.stride(0),
         dgu.stride(0))
    return dx
