"""The GEMM engine of tritonllm's matrix products (``linear``, ``linear_swiglu``, the LM-head loss,
LoRA, the grouped expert GEMMs reuse its configs): ``gemm(a, b, c, ...)``.

One persistent kernel computes C = A @ B for A [M, K] and B [K, N] of any
strides, so x W^T, dy W and dy^T x are the same kernel with different strides (no transposed
copies). Output tiles are visited in grouped-M order (GROUP_M row tiles sweep the column tiles
before moving on, so the B tiles they share stay in L2) by min(#SMs, #tiles) programs (one per
tile with ``GemmSettings.persistent`` off). Constexpr switches pick the epilogue (bias, residual,
accumulate-into-C, SwiGLU) and the operand loads: on Hopper with Triton's tensor descriptors (TMA,
``tl.make_tensor_descriptor``) when both operands have a unit stride and 16-byte aligned strides,
else masked pointer loads (also the path of the CPU interpreter). Edges are masked (pointer path) or
zero-filled / clipped by TMA, never rejected.
A problem with too few output tiles to fill the GPU and a long K (the LM head's dx = dlogits W of
one chunk of tokens) is split along K: SPLIT_K programs per tile write fp32 partial tiles that one
more kernel sums in a fixed order (deterministic).

Precision: fp32 accumulation for every dtype. float32 inputs use TF32 tensor cores on the GPU
(about 3e-4 relative error, like ``torch.backends.cuda.matmul.allow_tf32 = True``);
``allow_tf32=False`` selects IEEE fp32 dots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import gemm_sm90
from ._interpreter import interpreting
from .device import num_sms, smem_budget
from .gemm_settings import GemmSettings, gemm_settings
from .gemm_tiles import PLAIN, SWIGLU_FWD, tile_coords
from .launch import Launch, Plans, next_pow2
from .scratch import tile_counter, tma_scratch

# The switches a run chooses (flatten, TMA stores, the grid, ...) are gemm_settings.GemmSettings; the
# constants below are measured tuning facts.
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) tried by the autotuner; GROUP_M is 8.
GPU_CONFIGS = [
    (128, 256, 64, 3, 8),
    (128, 256, 64, 4, 8),
    (128, 128, 64, 3, 8),
    (128, 128, 64, 4, 8),
    (128, 128, 32, 4, 4),
    (64, 128, 64, 4, 4),
]
#: the same for fp8 operands (one byte each: twice the K per stage of the bf16 configs)
FP8_GPU_CONFIGS = [
    (128, 256, 128, 3, 8),
    (128, 128, 128, 4, 8),
    (128, 128, 128, 3, 8),
    (64, 128, 128, 4, 4),
    (128, 256, 64, 4, 8),
]
#: fp8 operand dtypes the GEMM takes (``a_scale`` / ``b_scale`` dequantize them)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: shared memory :func:`_config_smem` leaves out (barriers, layout conversions): a config's pipelined
#: operand tiles and store staging fit ``smem_budget(SMEM_RESERVE)`` (220 KiB on an H100 or H200)
SMEM_RESERVE = 7 * 1024
#: split-K: each split keeps at least this much of K (its fp32 partial tile, 4 BLOCK_M BLOCK_N
#: bytes written and read once, stays small next to its 2 BLOCK_M BLOCK_N K_split FLOPs) ...
SPLIT_K_MIN_K = 2048
#: ... at most this many splits ...
SPLIT_K_MAX = 8
#: ... and the count :func:`split_cost` estimates fastest, which charges the fp32 partials' traffic
#: (written by the GEMM, read back by the sum) at this many bytes per 128x128x64 product step of
#: one SM. Measured on an H100 (scripts/tune_linear.py splits, docs/perf/history.md): a step took
#: 0.4 us and the partials cost about 1.9 TB/s, so that dW of 16384x768x2304 ran 27% slower split
#: 6 ways (the best fill of its 108 tiles) than unsplit.
SPLIT_K_STEP_BYTES = 760_000


@triton.jit
def _operand_descs(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   A_K_CONTIGUOUS: tl.constexpr, B_N_CONTIGUOUS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tensor descriptors of A [M, K] and B [K, N] with [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N]
    blocks, each over its unit-stride layout (A_K_CONTIGUOUS: K is A's unit-stride dim, else M;
    B_N_CONTIGUOUS: N is B's, else K; the block is then transposed at the load)."""
    if A_K_CONTIGUOUS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1], block_shape=[BLOCK_K, BLOCK_M])
    if B_N_CONTIGUOUS:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[BLOCK_K, BLOCK_N])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    return a_desc, b_desc


@triton.jit
def _store_tile(desc, base, stride_m, stride_n, tile, m0, n0, M, N,
                USE_DESC: tl.constexpr, SUBTILE: tl.constexpr):
    """Store the fp32 ``tile`` [BM, BN] at rows m0.., columns n0.. of an [M, N] output, in the
    output's dtype: through the tensor descriptor ``desc`` (USE_DESC; as two [BM, BN/2] halves when
    SUBTILE; TMA clips the edges) or through masked pointers from ``base`` (strides in elements)."""
    BM: tl.constexpr = tile.shape[0]
    BN: tl.constexpr = tile.shape[1]
    if USE_DESC:
        if SUBTILE:
            left, right = tl.split(tl.permute(tl.reshape(tile, (BM, 2, BN // 2)), (0, 2, 1)))
            desc.store([m0, n0], left.to(desc.dtype))
            desc.store([m0, n0 + BN // 2], right.to(desc.dtype))
        else:
            desc.store([m0, n0], tile.to(desc.dtype))
    else:
        rm = tl.arange(0, BM)
        rn = tl.arange(0, BN)
        # int64 only for the tile origin; offsets inside a tile are int32 (fewer registers)
        ptrs = (base + m0.to(tl.int64) * stride_m + n0.to(tl.int64) * stride_n) + (
            rm[:, None] * stride_m + rn[None, :] * stride_n)
        mask = (m0 + rm < M)[:, None] & (n0 + rn < N)[None, :]
        tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr,  # A [M, K], strides (stride_am, stride_ak)
    b_ptr,  # B [K, N] (SWIGLU_FWD: [K, 2N], gate columns [0, N), up columns [N, 2N))
    c_ptr,  # C [M, N] output, read too when ACCUMULATE; SPLIT_K > 1: fp32 partials [SPLIT_K, M, N]
    gu_ptr,  # [M, 2N] out (STORE_GU): gate then up pre-activations, strides (stride_gm, 1)
    bias_ptr,  # [N] bias added to every row (HAS_BIAS)
    e_ptr,  # [M, N] residual added to C (HAS_RESIDUAL)
    sa_ptr,  # [M] fp32 scale of A's rows (SCALED): C = sa[m] sb[n] (A @ B) before the other epilogue terms
    sb_ptr,  # [N] fp32 scale of B's columns (SCALED)
    M, N, K,  # problem size (N: output columns of one accumulator)
    stride_am, stride_ak,  # element strides of A
    stride_bk, stride_bn,  # element strides of B
    stride_cs, stride_cm, stride_cn,  # element strides of C (stride_cs: between split-K partials)
    stride_gm,  # row stride of gu
    stride_em, stride_en,  # element strides of the residual
    EPILOGUE: tl.constexpr,  # PLAIN or SWIGLU_FWD
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # C += A @ B (beta = 1) instead of C = A @ B
    STORE_GU: tl.constexpr,  # SWIGLU_FWD: also write the pre-activations to gu
    USE_TMA: tl.constexpr,  # load A and B through tensor descriptors
    A_K_CONTIGUOUS: tl.constexpr,  # stride_ak == 1 (else stride_am == 1); TMA path only
    B_N_CONTIGUOUS: tl.constexpr,  # stride_bn == 1 (else stride_bk == 1); TMA path only
    TMA_STORE: tl.constexpr,  # store C and gu through tensor descriptors (unit column stride)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "tf32" or "ieee" (fp32 inputs only)
    SPLIT_K: tl.constexpr,  # programs per output tile, each over 1/SPLIT_K of K (PLAIN, no epilogue inputs)
    SCALED: tl.constexpr,  # PLAIN: multiply the product by the row scales of A and the column scales of B
    FP8: tl.constexpr,  # fp8 operands: fp32 accumulation promoted once per BLOCK_K (Hopper's fp8 MMA adds in less)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,  # GemmSettings.flatten (off under warp specialization)
    WARP_SPECIALIZE: tl.constexpr,  # GemmSettings.warp_specialize (TMA path only)
    EPILOGUE_SUBTILE: tl.constexpr,  # GemmSettings.epilogue_subtile (TMA_STORE only)
):
    GATED: tl.constexpr = EPILOGUE != 0
    WS: tl.constexpr = WARP_SPECIALIZE and USE_TMA
    FLAT: tl.constexpr = FLATTEN and not WS
    SUBTILE: tl.constexpr = EPILOGUE_SUBTILE and TMA_STORE
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # every split runs the same number of K blocks (a uniform inner loop for FLATTEN and warp
    # specialization); blocks past K are zero-filled by TMA or masked
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    if USE_TMA:
        a_desc, b_desc = _operand_descs(a_ptr, b_ptr, M, 2 * N if GATED else N, K, stride_am, stride_ak, stride_bk,
                                        stride_bn, A_K_CONTIGUOUS, B_N_CONTIGUOUS, BLOCK_M, BLOCK_N, BLOCK_K)
    STORE_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    if TMA_STORE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, STORE_N])
        if STORE_GU:
            g_desc = tl.make_tensor_descriptor(gu_ptr, shape=[M, N], strides=[stride_gm, 1],
                                               block_shape=[BLOCK_M, STORE_N])
            u_desc = tl.make_tensor_descriptor(gu_ptr + N, shape=[M, N], strides=[stride_gm, 1],
                                               block_shape=[BLOCK_M, STORE_N])
    else:
        c_desc = c_ptr
        g_desc = gu_ptr
        u_desc = gu_ptr
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # the epilogue recomputes its tile from this counter, one step behind the loop variable: no
    # value flows from a tile's prologue to its epilogue, so FLATTEN can overlap the two
    unit_c = tl.program_id(0) - tl.num_programs(0)
    for unit in tl.range(tl.program_id(0), num_tiles * SPLIT_K, tl.num_programs(0), flatten=FLAT,
                         warp_specialize=WS):
        pid_m, pid_n = tile_coords(unit % num_tiles, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        k_first = (unit // num_tiles) * k_steps
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if not USE_TMA:
            mask_m = m0 + rm < M
            mask_n = n0 + rn < N
            a_ptrs = (a_ptr + m0.to(tl.int64) * stride_am + (k_first * BLOCK_K).to(tl.int64) * stride_ak) + (
                rm[:, None] * stride_am + offs_k[None, :] * stride_ak)
            b_tile = b_ptr + n0.to(tl.int64) * stride_bn + (k_first * BLOCK_K).to(tl.int64) * stride_bk
            b_ptrs = b_tile + (offs_k[:, None] * stride_bk + rn[None, :] * stride_bn)
            if GATED:
                b_up_ptrs = (b_tile + N * stride_bn) + (offs_k[:, None] * stride_bk + rn[None, :] * stride_bn)
        for ki in range(k_steps):
            k0 = (k_first + ki) * BLOCK_K
            if USE_TMA:
                if A_K_CONTIGUOUS:
                    a = a_desc.load([m0, k0])
                else:
                    a = a_desc.load([k0, m0]).T
                if B_N_CONTIGUOUS:
                    b = b_desc.load([k0, n0])
                else:
                    b = b_desc.load([n0, k0]).T
            else:
                mask_k = offs_k < K - k0
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if FP8:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                if USE_TMA:
                    if B_N_CONTIGUOUS:
                        b_up = b_desc.load([k0, N + n0])
                    else:
                        b_up = b_desc.load([N + n0, k0]).T
                else:
                    b_up = tl.load(b_up_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
            if not USE_TMA:
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
                if GATED:
                    b_up_ptrs += BLOCK_K * stride_bk

        # epilogue: fp32 math on the accumulators, one cast at the store
        unit_c += tl.num_programs(0)
        pid_mc, pid_nc = tile_coords(unit_c % num_tiles, num_pid_m, num_pid_n, GROUP_M)
        mc = pid_mc * BLOCK_M
        nc = pid_nc * BLOCK_N
        if EPILOGUE == 0:
            if SCALED:
                sa = tl.load(sa_ptr + mc + rm, mask=mc + rm < M, other=0.0)
                sb = tl.load(sb_ptr + nc + rn, mask=nc + rn < N, other=0.0)
                acc = acc * sa[:, None] * sb[None, :]
            if HAS_BIAS or HAS_RESIDUAL or ACCUMULATE:
                mask_nc = nc + rn < N
                mask = (mc + rm < M)[:, None] & mask_nc[None, :]
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + nc + rn, mask=mask_nc, other=0.0).to(tl.float32)[None, :]
                if HAS_RESIDUAL:
                    e_ptrs = (e_ptr + mc.to(tl.int64) * stride_em + nc.to(tl.int64) * stride_en) + (
                        rm[:, None] * stride_em + rn[None, :] * stride_en)
                    acc += tl.load(e_ptrs, mask=mask, other=0.0).to(tl.float32)
                if ACCUMULATE:
                    if TMA_STORE and not SUBTILE:
                        acc += c_desc.load([mc, nc]).to(tl.float32)
                    else:
                        c_old = (c_ptr + mc.to(tl.int64) * stride_cm + nc.to(tl.int64) * stride_cn) + (
                            rm[:, None] * stride_cm + rn[None, :] * stride_cn)
                        acc += tl.load(c_old, mask=mask, other=0.0).to(tl.float32)
            c_split = c_ptr + (unit_c // num_tiles).to(tl.int64) * stride_cs
            _store_tile(c_desc, c_split, stride_cm, stride_cn, acc, mc, nc, M, N, TMA_STORE, SUBTILE)
        else:
            if STORE_GU:
                _store_tile(g_desc, gu_ptr, stride_gm, 1, acc, mc, nc, M, N, TMA_STORE, SUBTILE)
                _store_tile(u_desc, gu_ptr + N, stride_gm, 1, acc_up, mc, nc, M, N, TMA_STORE, SUBTILE)
            h = acc * tl.sigmoid(acc) * acc_up
            _store_tile(c_desc, c_ptr, stride_cm, stride_cn, h, mc, nc, M, N, TMA_STORE, SUBTILE)


@triton.jit
def _sum_splits_kernel(
    p_ptr,  # [S, M, N] fp32 split-K partials, contiguous
    c_ptr,  # [M, N] out: the sum over S in fixed order, strides (stride_cm, stride_cn)
    M, N, S,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(p_ptr + (s * M).to(tl.int64) * N + offs, mask=mask, other=0.0)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def _config_smem(cfg: triton.Config, args: dict) -> int:
    """Upper bound on a config's shared memory (bytes): the pipelined operand tiles, plus one
    [BLOCK_M, BLOCK_N] tile of the output dtype for each of: the TMA-store staging tile
    (TMA_STORE), the layout conversion of the accumulator for pointer stores or for the residual
    load, and the old C tile of ACCUMULATE. Checked against offline sm_90 compiles of every
    epilogue in fp32 and bf16: each extra buffer measured at most this size (the conversion takes
    1/8 to 1 tile by warps and dtype)."""
    kw = cfg.kwargs
    elem = args["a_ptr"].element_size()
    b_tiles = 2 if args["EPILOGUE"] != PLAIN else 1
    pipeline = cfg.num_stages * kw["BLOCK_K"] * (kw["BLOCK_M"] + kw["BLOCK_N"] * b_tiles) * elem
    tile = kw["BLOCK_M"] * kw["BLOCK_N"] * args["c_ptr"].element_size()
    tma_store = args.get("TMA_STORE", False)
    converts = not tma_store or args.get("HAS_RESIDUAL", False)
    extra_tiles = (tma_store + converts + args.get("ACCUMULATE", False))
    if tma_store and kw.get("EPILOGUE_SUBTILE", False):
        extra_tiles -= 0.5
    return int(pipeline + extra_tiles * tile)


def _shrink_to_fit(cfg: triton.Config, args: dict) -> triton.Config:
    """``cfg`` with fewer pipeline stages, then a shorter BLOCK_K, then smaller output tiles, until
    :func:`_config_smem` fits the shared-memory budget (float32 operands with two gated B tiles outgrow every
    tuned config)."""
    kw, stages, budget = dict(cfg.kwargs), cfg.num_stages, smem_budget(SMEM_RESERVE)
    while _config_smem(triton.Config(kw, num_stages=stages), args) > budget:
        if stages > 2:
            stages -= 1
        elif kw["BLOCK_K"] > 16:
            kw["BLOCK_K"] //= 2
        elif kw["BLOCK_N"] >= kw["BLOCK_M"] and kw["BLOCK_N"] > 16:
            kw["BLOCK_N"] //= 2
        elif kw["BLOCK_M"] > 16:
            kw["BLOCK_M"] //= 2
        else:
            break
    return triton.Config(kw, num_stages=stages, num_warps=cfg.num_warps)


def gated_too_large(meta: dict) -> bool:
    """A tile whose two gated accumulators would spill registers: more than 128x128 (256 fp32
    registers a thread at 8 warps)."""
    return meta["BLOCK_M"] * meta["BLOCK_N"] > 128 * 128


def prune_configs(configs, named_args, **kwargs):
    """Drop configs that overflow shared memory (:func:`_config_smem` over ``smem_budget(SMEM_RESERVE)``) or (gated
    epilogues, two accumulators) whose accumulators would spill registers; when none is left, the
    smallest one shrunk until it fits (:func:`_shrink_to_fit`). Also used by
    kernels.grouped_linear (no TMA_STORE / STORE_GU arguments there)."""
    args = {**named_args, **kwargs}
    gated, budget = args["EPILOGUE"] != PLAIN, smem_budget(SMEM_RESERVE)
    keep = [c for c in configs if _config_smem(c, args) <= budget and not (gated and gated_too_large(c.kwargs))]
    return keep or [_shrink_to_fit(min(configs, key=lambda c: _config_smem(c, args)), args)]


def _config(bm, bn, bk, stages, warps, flatten=None, warp_specialize=None, subtile=None) -> triton.Config:
    """A GEMM launch config; the knobs default to the settings in force (:func:`gemm_settings`).
    Warp-specialized configs run 4 warps: Triton partitions the loop on Hopper only then (offline
    sm_90a compile)."""
    settings = gemm_settings()
    ws = settings.warp_specialize if warp_specialize is None else warp_specialize
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                          "FLATTEN": settings.flatten if flatten is None else flatten, "WARP_SPECIALIZE": ws,
                          "EPILOGUE_SUBTILE": settings.epilogue_subtile if subtile is None else subtile},
                         num_stages=stages, num_warps=4 if ws else warps)


#: every flag of the problem, those :func:`prune_configs` reads included: a config tuned without a
#: residual (one output tile less of shared memory) must not be reused for the same shape with one
_AUTOTUNE_KEY = ["M", "N", "K", "EPILOGUE", "HAS_BIAS", "HAS_RESIDUAL", "ACCUMULATE", "STORE_GU", "USE_TMA",
                 "A_K_CONTIGUOUS", "B_N_CONTIGUOUS", "TMA_STORE", "PRECISION", "SPLIT_K", "SCALED"]


@functools.lru_cache(maxsize=None)
def tuned_kernel(fp8: bool, flatten: bool, warp_specialize: bool, subtile: bool):
    """_matmul_kernel's autotuner over :data:`GPU_CONFIGS` (``fp8``: :data:`FP8_GPU_CONFIGS`) with these
    knobs (:class:`GemmSettings`'s ``flatten``, ``warp_specialize``, ``epilogue_subtile``)."""
    return triton.autotune(
        configs=[_config(*cfg, flatten, warp_specialize, subtile) for cfg in (FP8_GPU_CONFIGS if fp8 else GPU_CONFIGS)],
        key=_AUTOTUNE_KEY,
        prune_configs_by={"early_config_prune": prune_configs},
        restore_value=["c_ptr"],  # ACCUMULATE reads C: every timed config must start from the same C
    )(_matmul_kernel)


#: launch plans per problem (:func:`_gemm_key`): the kernel's Launch with the autotuner's choice
#: (made on the problem's first launch), its integer arguments and the split-K sum's Launch; later
#: launches skip the planning and the autotuner's per-call argument scan (the key holds the settings:
#: a change of :class:`GemmSettings` plans again; scripts/tune_linear.py clears it after changing configs)
_LAUNCH_CONFIGS = Plans()
#: the kernel's tensor arguments, its runtime arguments after them, and its constexpr flags, as _gemm_plan
#: names them
_TENSOR_ARGS = ("a_ptr", "b_ptr", "c_ptr", "gu_ptr", "bias_ptr", "e_ptr", "sa_ptr", "sb_ptr")
_INT_ARGS = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cs", "stride_cm", "stride_cn",
             "stride_gm", "stride_em", "stride_en")
_FLAG_ARGS = ("EPILOGUE", "HAS_BIAS", "HAS_RESIDUAL", "ACCUMULATE", "STORE_GU", "USE_TMA", "A_K_CONTIGUOUS",
              "B_N_CONTIGUOUS", "TMA_STORE", "PRECISION", "SPLIT_K", "SCALED", "FP8")


def _interpreter_config(M: int, N: int, K: int) -> dict:
    """One fixed config under the interpreter: few programs, big numpy blocks, no autotuning."""
    clamp = lambda n, hi: min(max(next_pow2(n), 16), hi)  # noqa: E731
    return {"BLOCK_M": clamp(M, 128), "BLOCK_N": clamp(N, 256), "BLOCK_K": clamp(K, 256), "GROUP_M": 8,
            "FLATTEN": False, "WARP_SPECIALIZE": False, "EPILOGUE_SUBTILE": False}


def _tma_operand(t: torch.Tensor) -> bool | None:
    """For a 2-D operand: True if its last dim is the unit-stride one, False if its first dim is,
    None if a tensor descriptor cannot address it (no unit stride, or a misaligned stride/base)."""
    if t.data_ptr() % 16:
        return None
    for unit, other in ((1, 0), (0, 1)):
        if t.stride(unit) == 1 and (t.stride(other) * t.element_size()) % 16 == 0:
            return unit == 1
    return None


@functools.lru_cache(maxsize=None)
def _tma_supported(device: torch.device) -> bool:
    return (not interpreting() and device.type == "cuda" and hasattr(tl, "make_tensor_descriptor")
            and torch.cuda.get_device_capability(device)[0] >= 9)


def split_fill(M: int, N: int, splits: int, sms: int) -> float:
    """Busy fraction of the SMs over the waves of an M x N product's 128x128 tiles split ``splits`` ways."""
    units = triton.cdiv(M, 128) * triton.cdiv(N, 128) * splits
    return units / (triton.cdiv(units, sms) * sms)


def split_cost(M: int, N: int, K: int, splits: int, sms: int) -> float:
    """:func:`split_k_for`'s estimate of an M x N x K product's time split ``splits`` ways along K,
    in 128x128x64 steps of one SM: the waves of its 128x128 tiles' programs times each program's K
    steps, plus the fp32 partials' 8 bytes an element a split (written, then read by the sum)."""
    units = triton.cdiv(M, 128) * triton.cdiv(N, 128) * splits
    steps = triton.cdiv(triton.cdiv(K, 64), splits)
    traffic = 8 * splits * M * N if splits > 1 else 0
    return triton.cdiv(units, sms) * steps + traffic / SPLIT_K_STEP_BYTES


def split_k_for(M: int, N: int, K: int, sms: int) -> int:
    """Splits along K for a product with too few output tiles to fill ``sms`` SMs (tiles counted
    at 128x128): the fewest splits of least :func:`split_cost`, each split keeping at least
    SPLIT_K_MIN_K of K. 1 when the tiles already fill the GPU."""
    most = min(SPLIT_K_MAX, K // SPLIT_K_MIN_K)
    if triton.cdiv(M, 128) * triton.cdiv(N, 128) >= sms or most < 2:
        return 1
    return min(range(1, most + 1), key=lambda s: split_cost(M, N, K, s, sms))


def _gemm_plan(a, b, c, bias, residual, gu, epilogue, accumulate, allow_tf32, use_tma, split_k, a_scale=None,
               b_scale=None, dynamic=False, settings: GemmSettings | None = None):
    """The kernel arguments, grid and launch-cache key of :func:`gemm` (C = the fp32 partials
    when split along K) under ``settings`` (None: those in force)."""
    settings = gemm_settings() if settings is None else settings
    if (a_scale is None) != (b_scale is None) or (a_scale is not None and epilogue != PLAIN):
        raise ValueError("a_scale and b_scale go together, with the PLAIN epilogue")
    M, K = a.shape
    N = c.shape[1]
    a_k, b_n = _tma_operand(a), _tma_operand(b)
    can_tma = K > 0 and a_k is not None and b_n is not None
    if use_tma is None:
        use_tma = can_tma and _tma_supported(a.device)
    elif use_tma and not can_tma:
        raise ValueError("use_tma=True needs operands with a unit stride and 16-byte aligned strides")
    simple = epilogue == PLAIN and bias is None and residual is None and not accumulate
    if split_k is None:
        split_k = split_k_for(M, N, K, num_sms()) if simple else 1
    elif split_k > 1 and not simple:
        raise ValueError("split_k > 1 needs the PLAIN epilogue without bias, residual or accumulate")
    out = c if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=c.device)
    store_gu = epilogue == SWIGLU_FWD and gu is not None
    tma_store = (settings.tma_store and bool(use_tma) and split_k == 1 and _tma_operand(c) is True
                 and (not store_gu or (_tma_operand(gu) is True and (N * gu.element_size()) % 16 == 0)))
    precision = "ieee" if (a.dtype == torch.float32 and not allow_tf32) else "tf32"
    args = dict(
        a_ptr=a, b_ptr=b, c_ptr=out, gu_ptr=c if gu is None else gu, bias_ptr=c if bias is None else bias,
        e_ptr=c if residual is None else residual,
        sa_ptr=c if a_scale is None else a_scale, sb_ptr=c if b_scale is None else b_scale,
        M=M, N=N, K=K,
        stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
        stride_cs=M * N if split_k > 1 else 0, stride_cm=out.stride(-2), stride_cn=out.stride(-1),
        stride_gm=0 if gu is None else gu.stride(0),
        stride_em=0 if residual is None else residual.stride(0),
        stride_en=0 if residual is None else residual.stride(1),
        EPILOGUE=epilogue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, ACCUMULATE=accumulate,
        STORE_GU=store_gu, USE_TMA=bool(use_tma), A_K_CONTIGUOUS=bool(a_k), B_N_CONTIGUOUS=bool(b_n),
        TMA_STORE=tma_store, PRECISION=precision, SPLIT_K=split_k, SCALED=a_scale is not None,
        FP8=a.dtype in FP8_DTYPES,
    )
    sms = max(1, num_sms() - settings.sm_margin)

    def grid(meta):
        units = split_k * triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        persistent = settings.persistent or (dynamic and "PINGPONG" in meta)  # PINGPONG: a gemm_sm90 config
        return (min(sms, units) if persistent else units,)

    key = (M, N, K, epilogue, bias is not None, residual is not None, accumulate, store_gu, bool(use_tma), a_k, b_n,
           tma_store, precision, split_k, a.dtype, c.dtype, a_scale is not None)
    return args, grid, key


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, gu: torch.Tensor | None = None, epilogue: int = PLAIN,
         accumulate: bool = False, allow_tf32: bool = True, use_tma: bool | None = None,
         split_k: int | None = None, config: triton.Config | None = None, a_scale: torch.Tensor | None = None,
         b_scale: torch.Tensor | None = None, dynamic: bool | None = None) -> torch.Tensor:
    """``c = a @ b`` (+ epilogue) in place; the building block of every linear op (no input checks).

    a [M, K] and b [K, N] may have any strides (pass ``w.t()`` for x W^T). ``PLAIN`` adds ``bias``
    [N] and ``residual`` [M, N] when given, and the old value of c when ``accumulate``.
    ``SWIGLU_FWD`` takes b [K, 2N] (gate columns, then up columns), writes c [M, N] = silu(gate) * up
    and, when ``gu`` [M, 2N] (unit column stride) is given, the pre-activations [gate, up] into it.
    ``use_tma`` forces the tensor-descriptor path (True) or the pointer path (False); None picks
    TMA where it can. ``split_k`` splits K over that many programs per output tile (PLAIN with no
    bias, residual or accumulate; fp32 partials summed in a fixed order); None picks it
    (:func:`split_k_for`). ``config`` launches that config instead of the autotuner's choice
    (scripts/tune_linear.py); one of ``gemm_sm90.configs()`` (it has ``PINGPONG``; ``configs(gated=True)``
    for ``SWIGLU_FWD``) runs the warp-specialized Hopper kernel. fp8 operands (``FP8_DTYPES``, GPU only) take ``a_scale`` [M] and
    ``b_scale`` [N] (fp32, ``PLAIN``): c = a_scale[m] b_scale[n] (a @ b), fp32 accumulation
    promoted once per BLOCK_K. ``dynamic`` sets ``GemmSettings.dynamic`` for this call (None: the setting in
    force). The other choices come from :func:`gemm_settings` (:func:`gemm_settings.configure_gemm`).
    """
    if c.shape[0] == 0 or c.shape[1] == 0:
        return c
    settings = gemm_settings()
    dynamic = settings.dynamic if dynamic is None else dynamic
    key = None if config is not None else _gemm_key(a, b, c, bias, residual, gu, epilogue, accumulate, allow_tf32,
                                                   use_tma, split_k, a_scale, dynamic, settings)
    plan = None if key is None else _LAUNCH_CONFIGS.get(key)
    if plan is None:
        plan = _first_gemm(a, b, c, bias, residual, gu, epilogue, accumulate, allow_tf32, use_tma, split_k, config,
                           a_scale, b_scale, dynamic, settings)
        if key is not None:
            _LAUNCH_CONFIGS[key] = plan
        return c
    launch, ints, splits, sum_splits, tma, dynamic = plan
    out = c if splits == 1 else torch.empty((splits, c.shape[0], c.shape[1]), dtype=torch.float32, device=c.device)
    if tma:
        triton.set_allocator(tma_scratch)  # per call: the allocator is per thread (autograd runs backward elsewhere)
    launch(a, b, out, c if gu is None else gu, c if bias is None else bias, c if residual is None else residual,
           c if a_scale is None else a_scale, c if b_scale is None else b_scale, *ints,
           *(() if dynamic is None else (tile_counter() if dynamic else c,)))
    if splits > 1:
        sum_splits(out, c, *ints[:2], splits, c.stride(0), c.stride(1))
    return c


def _gemm_key(a, b, c, bias, residual, gu, epilogue, accumulate, allow_tf32, use_tma, split_k, a_scale=None,
              dynamic=False, settings: GemmSettings | None = None) -> tuple:
    """What a gemm launch plan depends on: shapes, strides, dtypes, the 16-byte alignment of the
    operands (TMA), the options, the device and the settings (None: those in force)."""
    return (a.shape, a.stride(), b.shape, b.stride(), c.shape, c.stride(), a.dtype, b.dtype, c.dtype,
            a.data_ptr() % 16, b.data_ptr() % 16, c.data_ptr() % 16, c.device,
            None if bias is None else bias.dtype,
            None if residual is None else (residual.stride(), residual.dtype),
            None if gu is None else (gu.stride(), gu.dtype, gu.data_ptr() % 16),
            epilogue, accumulate, allow_tf32, use_tma, split_k, a_scale is not None, dynamic,
            gemm_settings() if settings is None else settings)


def _first_gemm(a, b, c, bias, residual, gu, epilogue, accumulate, allow_tf32, use_tma, split_k, config,
                a_scale=None, b_scale=None, dynamic=False, settings: GemmSettings | None = None) -> tuple:
    """Plan a problem and launch it once (through the autotuner on the GPU, which picks the config
    on a problem's first launch); return the plan later launches of the problem reuse:
    ``(Launch, integer arguments, SPLIT_K, split-sum Launch or None, uses TMA, dynamic)``, dynamic None for
    _matmul_kernel; the WS kernel takes tile_counter() after the integers when dynamic, else an unread
    pointer (no per-call counter lookup)."""
    settings = gemm_settings() if settings is None else settings
    args, grid, key = _gemm_plan(a, b, c, bias, residual, gu, epilogue, accumulate, allow_tf32, use_tma, split_k,
                                 a_scale, b_scale, dynamic, settings)
    tma = args["USE_TMA"] and not interpreting()
    if tma:
        triton.set_allocator(tma_scratch)
    flags: tuple[str, ...] = _FLAG_ARGS
    kernel = _matmul_kernel
    ints = tuple(args[k] for k in _INT_ARGS)
    tensors = tuple(args[k] for k in _TENSOR_ARGS)
    if interpreting():
        meta = _interpreter_config(*key[:3])
    elif config is not None:
        meta = config.all_kwargs()
        if "PINGPONG" in meta:  # a gemm_sm90 config: its kernel, where it applies
            if not gemm_sm90.applies(args, a.dtype, c.dtype):
                raise ValueError("config: a gemm_sm90 config (PINGPONG) needs a problem its kernel takes: 16-bit, "
                                 "PLAIN with at most a residual or SWIGLU_FWD, unsplit, through tensor descriptors")
            if epilogue != PLAIN and config.kwargs not in [g.kwargs for g in gemm_sm90.configs(gated=True)]:
                raise ValueError("config: a SWIGLU_FWD problem takes one of gemm_sm90.configs(gated=True)")
            kernel, flags = gemm_sm90.ws_matmul_kernel, gemm_sm90.FLAG_ARGS
    elif (settings.sm90_ws and torch.cuda.get_device_capability(a.device)[0] == 9
          and (epilogue == PLAIN or settings.sm90_ws_gated) and gemm_sm90.applies(args, a.dtype, c.dtype)):
        kernel, flags = gemm_sm90.ws_matmul_kernel, gemm_sm90.FLAG_ARGS
        gemm_sm90.tuned(args)[grid](*tensors, *ints, tile_counter() if dynamic else c, DYNAMIC=dynamic,
                                    **{k: args[k] for k in flags})
        meta = gemm_sm90.tuned(args).best_config.all_kwargs()
    else:
        tuned = tuned_kernel(args["FP8"], settings.flatten, settings.warp_specialize, settings.epilogue_subtile)
        tuned[grid](**args)
        meta = tuned.best_config.all_kwargs()
    dynamic = None if kernel is _matmul_kernel else dynamic
    launch = Launch(kernel, grid(meta), **{k: args[k] for k in flags}, **({} if dynamic is None else
                                                                          {"DYNAMIC": dynamic}), **meta)
    if interpreting() or config is not None:
        launch(*tensors, *ints, *(() if dynamic is None else (tile_counter() if dynamic else c,)))
    sum_splits = None
    if args["SPLIT_K"] > 1:
        M, N = c.shape
        block_m, block_n = (32, 128) if not interpreting() else (64, 64)
        sum_splits = Launch(_sum_splits_kernel, (triton.cdiv(M, block_m), triton.cdiv(N, block_n)),
                            BLOCK_M=block_m, BLOCK_N=block_n)
        sum_splits(args["c_ptr"], c, M, N, args["SPLIT_K"], c.stride(0), c.stride(1))
    return launch, ints, args["SPLIT_K"], sum_splits, tma, dynamic


def as_matrix(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` [..., n] as a 2-D [rows, n] tensor; a 2-D tensor keeps its strides (the GEMM takes
    any), others are viewed when their leading dims fold into one and copied otherwise."""
    return t if t.dim() == 2 else t.reshape(-1, n)
