"""Linear layers on one Triton GEMM: ``linear`` (bias and residual epilogues) and ``linear_swiglu``.

Shapes: x [M, K] (leading dimensions folded into M), W [N, K] (PyTorch layout), b [N], r [M, N].

linear, forward:   y = x W^T + b + r
linear, backward:  dx = dy W,   dW = dy^T x,   db = sum_m dy[m, :],   dr = dy

linear_swiglu, with w13 [2F, K] = [W1; W3] (gate rows [0, F), up rows [F, 2F)):
  forward:   g = x W1^T,  u = x W3^T,  h = silu(g) * u,  silu(g) = g * sigmoid(g)
             (one GEMM with two accumulators: the gate and up tiles of the same output columns)
  backward:  recompute g and u with the same GEMM; with s = sigmoid(g)
             dg = dh * u * s * (1 + g * (1 - s)),   du = dh * silu(g)
             written as dgu = [dg, du] [M, 2F] by the GEMM's epilogue; then
             dx = dgu w13,   dw13 = dgu^T x

The GEMM (``gemm``): one persistent kernel computes C = A @ B for A [M, K] and B [K, N] of any
strides, so x W^T, dy W and dy^T x are the same kernel with different strides (no transposed
copies). Output tiles are visited in grouped-M order (GROUP_M row tiles sweep the column tiles
before moving on, so the B tiles they share stay in L2) by min(#SMs, #tiles) programs. Constexpr
switches pick the epilogue (bias, residual, accumulate-into-C, SwiGLU forward/backward) and the
operand loads: on Hopper with Triton's tensor descriptors (TMA, ``tl.make_tensor_descriptor``)
when both operands have a unit stride and 16-byte aligned strides, else masked pointer loads (also
the path of the CPU interpreter). Edges are masked (pointer path) or zero-filled by TMA, never
rejected.

Precision: fp32 accumulation for every dtype. float32 inputs use TF32 tensor cores on the GPU
(about 3e-4 relative error, like ``torch.backends.cuda.matmul.allow_tf32 = True``);
``allow_tf32=False`` selects IEEE fp32 dots. The bias gradient is reduced deterministically:
per-program partial sums over row groups, then a fixed-order sum of the partials.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import check_same_device, check_same_dtype, check_tensor, interpreting, next_pow2, num_sms

#: GEMM epilogues (the ``epilogue`` argument of :func:`gemm`).
PLAIN, SWIGLU_FWD, SWIGLU_BWD = 0, 1, 2

# Tuning knobs for the GPU (unmeasured starting points from Triton's persistent-matmul tutorial).
#: flatten the persistent tile loop into the K loop (``tl.range(flatten=...)``): lets the
#: pipeliner overlap one tile's epilogue with the next tile's loads; try True on Hopper.
FLATTEN = False
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) tried by the autotuner; GROUP_M is 8.
GPU_CONFIGS = [
    (128, 256, 64, 3, 8),
    (128, 256, 64, 4, 8),
    (128, 128, 64, 3, 8),
    (128, 128, 64, 4, 8),
    (128, 128, 32, 4, 4),
    (64, 128, 64, 4, 4),
]
#: shared memory a config may use for its pipelined operand tiles (H100/H200: 227 KiB per block)
SMEM_LIMIT = 220 * 1024


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Row and column tile of ``tile_id`` in grouped-M order: GROUP_M row tiles sweep every
    column tile before the next group starts (shared with kernels.grouped_linear)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id % tiles_per_group
    return first_m + local % group_size, local // group_size


@triton.jit
def _matmul_kernel(
    a_ptr,  # A [M, K], strides (stride_am, stride_ak)
    b_ptr,  # B [K, N] (gated epilogues: [K, 2N], gate columns [0, N), up columns [N, 2N))
    c_ptr,  # C [M, N] output (SWIGLU_BWD: [M, 2N], dgate then dup); also read when ACCUMULATE
    bias_ptr,  # [N] bias added to every row (HAS_BIAS)
    e_ptr,  # [M, N] epilogue input: the residual (HAS_RESIDUAL) or dh (SWIGLU_BWD)
    M, N, K,  # problem size (N: output columns of one accumulator)
    stride_am, stride_ak,  # element strides of A
    stride_bk, stride_bn,  # element strides of B
    stride_cm, stride_cn,  # element strides of C
    stride_em, stride_en,  # element strides of the epilogue input
    EPILOGUE: tl.constexpr,  # PLAIN, SWIGLU_FWD or SWIGLU_BWD
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # C += A @ B (beta = 1) instead of C = A @ B
    USE_TMA: tl.constexpr,  # load A and B through tensor descriptors
    A_K_CONTIGUOUS: tl.constexpr,  # stride_ak == 1 (else stride_am == 1); TMA path only
    B_N_CONTIGUOUS: tl.constexpr,  # stride_bn == 1 (else stride_bk == 1); TMA path only
    PRECISION: tl.constexpr,  # tl.dot input_precision: "tf32" or "ieee" (fp32 inputs only)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    GATED: tl.constexpr = EPILOGUE != 0
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    if USE_TMA:
        if A_K_CONTIGUOUS:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1],
                                               block_shape=[BLOCK_K, BLOCK_M])
        n_b = 2 * N if GATED else N
        if B_N_CONTIGUOUS:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, n_b], strides=[stride_bk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[n_b, K], strides=[stride_bn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        # int64 only for the tile origins; offsets inside a tile are int32 (fewer registers)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        mask_m = m0 + rm < M
        mask_n = n0 + rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if not USE_TMA:
            a_ptrs = (a_ptr + m0.to(tl.int64) * stride_am) + (rm[:, None] * stride_am + offs_k[None, :] * stride_ak)
            b_tile = b_ptr + n0.to(tl.int64) * stride_bn
            b_ptrs = b_tile + (offs_k[:, None] * stride_bk + rn[None, :] * stride_bn)
            if GATED:
                b_up_ptrs = (b_tile + N * stride_bn) + (offs_k[:, None] * stride_bk + rn[None, :] * stride_bn)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
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
        mask = mask_m[:, None] & mask_n[None, :]
        c_tile = c_ptr + m0.to(tl.int64) * stride_cm + n0.to(tl.int64) * stride_cn
        c_ptrs = c_tile + (rm[:, None] * stride_cm + rn[None, :] * stride_cn)
        e_ptrs = (e_ptr + m0.to(tl.int64) * stride_em + n0.to(tl.int64) * stride_en) + (
            rm[:, None] * stride_em + rn[None, :] * stride_en)
        if EPILOGUE == 0:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + n0 + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_RESIDUAL:
                acc += tl.load(e_ptrs, mask=mask, other=0.0).to(tl.float32)
            if ACCUMULATE:
                acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        elif EPILOGUE == 1:
            h = acc * tl.sigmoid(acc) * acc_up
            tl.store(c_ptrs, h.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            dh = tl.load(e_ptrs, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(acc)
            dgate = dh * acc_up * sig * (1.0 + acc * (1.0 - sig))
            dup = dh * acc * sig
            tl.store(c_ptrs, dgate.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(c_ptrs + N * stride_cn, dup.to(c_ptr.dtype.element_ty), mask=mask)


def _prune_configs(configs, named_args, **kwargs):
    """Drop configs whose pipelined operand tiles overflow shared memory, or (gated epilogues,
    two accumulators) whose accumulators would spill registers."""
    args = {**named_args, **kwargs}
    elem = args["a_ptr"].element_size()
    gated = args["EPILOGUE"] != PLAIN

    def smem(cfg):
        kw = cfg.kwargs
        return cfg.num_stages * kw["BLOCK_K"] * (kw["BLOCK_M"] + kw["BLOCK_N"] * (2 if gated else 1)) * elem

    keep = [c for c in configs if smem(c) <= SMEM_LIMIT and not (gated and c.kwargs["BLOCK_N"] > 128)]
    return keep or [min(configs, key=smem)]


_matmul_kernel_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "FLATTEN": FLATTEN},
                      num_stages=stages, num_warps=warps)
        for bm, bn, bk, stages, warps in GPU_CONFIGS
    ],
    key=["M", "N", "K", "EPILOGUE", "ACCUMULATE", "USE_TMA", "A_K_CONTIGUOUS", "B_N_CONTIGUOUS", "PRECISION"],
    prune_configs_by={"early_config_prune": _prune_configs},
    restore_value=["c_ptr"],  # ACCUMULATE reads C: every timed config must start from the same C
)(_matmul_kernel)


def _interpreter_config(M: int, N: int, K: int) -> dict:
    """One fixed config under the interpreter: few programs, big numpy blocks, no autotuning."""
    clamp = lambda n, hi: min(max(next_pow2(n), 16), hi)  # noqa: E731
    return {"BLOCK_M": clamp(M, 128), "BLOCK_N": clamp(N, 256), "BLOCK_K": clamp(K, 256), "GROUP_M": 8,
            "FLATTEN": False}


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


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, bias: torch.Tensor | None = None,
         epilogue_input: torch.Tensor | None = None, epilogue: int = PLAIN, accumulate: bool = False,
         allow_tf32: bool = True, use_tma: bool | None = None) -> torch.Tensor:
    """``c = a @ b`` (+ epilogue) in place; the building block of every linear op (no input checks).

    a [M, K] and b [K, N] may have any strides (pass ``w.t()`` for x W^T). Gated epilogues take
    b [K, 2N] (gate columns, then up columns); ``SWIGLU_BWD`` writes c [M, 2N] = [dgate, dup]
    from dh = ``epilogue_input`` [M, N]. ``PLAIN`` adds ``bias`` [N] and ``epilogue_input`` (a
    residual [M, N]) when given, and the old value of c when ``accumulate``. ``use_tma`` forces
    the tensor-descriptor path (True) or the pointer path (False); None picks TMA where it can.
    """
    M, K = a.shape
    N = c.shape[1] // 2 if epilogue == SWIGLU_BWD else c.shape[1]
    if M == 0 or N == 0:
        return c
    a_k, b_n = _tma_operand(a), _tma_operand(b)
    can_tma = K > 0 and a_k is not None and b_n is not None
    if use_tma is None:
        use_tma = can_tma and _tma_supported(a.device)
    elif use_tma and not can_tma:
        raise ValueError("use_tma=True needs operands with a unit stride and 16-byte aligned strides")
    if use_tma and not interpreting():
        triton.set_allocator(_tma_scratch)  # per call: the allocator is per thread (autograd runs backward elsewhere)
    e = epilogue_input
    precision = "ieee" if (a.dtype == torch.float32 and not allow_tf32) else "tf32"
    args = dict(
        a_ptr=a, b_ptr=b, c_ptr=c, bias_ptr=c if bias is None else bias, e_ptr=c if e is None else e,
        M=M, N=N, K=K,
        stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
        stride_cm=c.stride(0), stride_cn=c.stride(1),
        stride_em=0 if e is None else e.stride(0), stride_en=0 if e is None else e.stride(1),
        EPILOGUE=epilogue, HAS_BIAS=bias is not None, HAS_RESIDUAL=epilogue == PLAIN and e is not None,
        ACCUMULATE=accumulate, USE_TMA=bool(use_tma), A_K_CONTIGUOUS=bool(a_k), B_N_CONTIGUOUS=bool(b_n),
        PRECISION=precision,
    )
    sms = num_sms()

    def grid(meta):
        return (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    if interpreting():
        _matmul_kernel[grid](**args, **_interpreter_config(M, N, K))
    else:
        _matmul_kernel_tuned[grid](**args)
    return c


@triton.jit
def _sum_rows_kernel(
    x_ptr,  # [M, N] rows to sum, strides (stride_xm, stride_xn)
    out_ptr,  # [R, N] out[r] = sum of rows [r * rows_per_prog, (r + 1) * rows_per_prog), row stride stride_om
    M, N, rows_per_prog,  # rows_per_prog: a multiple of BLOCK_M
    stride_xm, stride_xn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    row_start = pid_r * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xn
        acc += tl.load(ptrs, mask=(rows < row_end)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_r.to(tl.int64) * stride_om + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=mask_n)


def sum_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.sum(0)`` of a 2-D tensor in fp32, deterministically: partial sums of row groups by
    parallel programs, then one fixed-order sum of the partials; returned in ``dtype``."""
    M, N = x.shape
    if M == 0:
        return torch.zeros(N, dtype=dtype, device=x.device)
    block_m, block_n = (64, 64) if interpreting() else (32, 128)
    col_blocks = triton.cdiv(N, block_n)
    groups = max(1, min(triton.cdiv(M, block_m), triton.cdiv(4 * num_sms(), col_blocks)))
    rows_per_prog = triton.cdiv(triton.cdiv(M, groups), block_m) * block_m
    groups = max(1, triton.cdiv(M, rows_per_prog))
    out = torch.empty((1, N), dtype=dtype, device=x.device)
    partial = out if groups == 1 else torch.empty((groups, N), dtype=torch.float32, device=x.device)
    _sum_rows_kernel[(col_blocks, groups)](x, partial, M, N, rows_per_prog, x.stride(0), x.stride(1),
                                           partial.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    if groups > 1:
        _sum_rows_kernel[(col_blocks, 1)](partial, out, groups, N, triton.cdiv(groups, block_m) * block_m,
                                          partial.stride(0), partial.stride(1), out.stride(0),
                                          BLOCK_M=block_m, BLOCK_N=block_n)
    return out.view(N)


def as_matrix(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` [..., n] as a 2-D [rows, n] tensor; a 2-D tensor keeps its strides (the GEMM takes
    any), others are viewed when their leading dims fold into one and copied otherwise."""
    return t if t.dim() == 2 else t.reshape(-1, n)


def check_linear_inputs(x: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight") -> None:
    """x [..., K] and a weight [N, K]: floating tensors on one device, one dtype, matching K."""
    check_tensor("x", x, min_ndim=1)
    check_tensor(weight_name, weight, ndim=2)
    check_same_device(x=x, **{weight_name: weight})
    check_same_dtype(x=x, **{weight_name: weight})
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{weight_name} has shape {tuple(weight.shape)}: its second dimension must equal "
                         f"x's last dimension K={x.shape[-1]}")


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, allow_tf32: bool = True) -> torch.Tensor:
    """y = x @ weight.T (+ bias) (+ residual) for x [..., K], weight [N, K]; y [..., N] in x's dtype."""
    check_linear_inputs(x, weight)
    N, K = weight.shape
    out_shape = tuple(x.shape[:-1]) + (N,)
    if bias is not None:
        check_tensor("bias", bias)
        check_same_device(x=x, bias=bias)
        check_same_dtype(x=x, bias=bias)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        check_tensor("residual", residual)
        check_same_device(x=x, residual=residual)
        check_same_dtype(x=x, residual=residual)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"residual must have the output's shape {out_shape}, got {tuple(residual.shape)}")
    x2 = as_matrix(x, K)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    gemm(x2, weight.t(), y, bias=bias, epilogue_input=None if residual is None else as_matrix(residual, N),
         allow_tf32=allow_tf32)
    return y.view(out_shape)


def linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_dx: bool = True,
               need_dw: bool = True, need_db: bool = False, allow_tf32: bool = True):
    """(dx, dW, db) of y = x W^T + b: dx = dy W, dW = dy^T x, db = sum of dy's rows (None where not needed)."""
    N, K = weight.shape
    dy2 = as_matrix(dy, N)
    x2 = as_matrix(x, K)
    dx = dw = db = None
    if need_dx:
        dx = gemm(dy2, weight, torch.empty((dy2.shape[0], K), dtype=x.dtype, device=x.device),
                  allow_tf32=allow_tf32).view(x.shape)
    if need_dw:
        dw = gemm(dy2.t(), x2, torch.empty((N, K), dtype=weight.dtype, device=weight.device), allow_tf32=allow_tf32)
    if need_db:
        db = sum_rows(dy2, weight.dtype)
    return dx, dw, db


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, allow_tf32):
        y = linear_fwd(x, weight, bias, residual, allow_tf32)
        ctx.save_for_backward(x, weight)
        ctx.allow_tf32 = allow_tf32
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db, need_dr = ctx.needs_input_grad[:4]
        dx, dw, db = linear_bwd(dy, x, weight, need_dx, need_dw, need_db, ctx.allow_tf32)
        return dx, dw, db, dy if need_dr else None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, *, allow_tf32: bool = True) -> torch.Tensor:
    """``y = x @ weight.T (+ bias) (+ residual)`` with Triton GEMMs forward and backward.

    x [..., K], weight [N, K] (``nn.Linear`` layout), bias [N], residual [..., N] (added in the
    GEMM's epilogue: ``residual + x @ W.T`` for attention/MLP output projections). All tensors
    share one floating dtype (fp32, fp16, bf16); returns [..., N] in that dtype. fp32 accumulation;
    fp32 inputs use TF32 tensor cores on the GPU unless ``allow_tf32=False``.
    Backward: dx = dy W, dW = dy^T x, db = sum of dy's rows (deterministic), d(residual) = dy.
    """
    return LinearFunction.apply(x, weight, bias, residual, allow_tf32)


def linear_swiglu_fwd(x: torch.Tensor, w13: torch.Tensor, allow_tf32: bool = True) -> torch.Tensor:
    """h = silu(x W1^T) * (x W3^T) for w13 = [W1; W3] [2F, K]; h [..., F] in x's dtype."""
    check_linear_inputs(x, w13, "w13")
    if w13.shape[0] % 2:
        raise ValueError(f"w13 must stack gate and up rows [2F, K]; got an odd first dimension {w13.shape[0]}")
    F, K = w13.shape[0] // 2, w13.shape[1]
    x2 = as_matrix(x, K)
    h = torch.empty((x2.shape[0], F), dtype=x.dtype, device=x.device)
    gemm(x2, w13.t(), h, epilogue=SWIGLU_FWD, allow_tf32=allow_tf32)
    return h.view(tuple(x.shape[:-1]) + (F,))


def linear_swiglu_bwd(dh: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, need_dx: bool = True,
                      need_dw: bool = True, allow_tf32: bool = True):
    """(dx, dw13): recompute gate/up, form dgu = [dgate, dup] in the GEMM epilogue, then
    dx = dgu w13 and dw13 = dgu^T x."""
    two_f, K = w13.shape
    x2 = as_matrix(x, K)
    dgu = torch.empty((x2.shape[0], two_f), dtype=x.dtype, device=x.device)
    gemm(x2, w13.t(), dgu, epilogue=SWIGLU_BWD, epilogue_input=as_matrix(dh, two_f // 2), allow_tf32=allow_tf32)
    dx = dw = None
    if need_dx:
        dx = gemm(dgu, w13, torch.empty((x2.shape[0], K), dtype=x.dtype, device=x.device),
                  allow_tf32=allow_tf32).view(x.shape)
    if need_dw:
        dw = gemm(dgu.t(), x2, torch.empty((two_f, K), dtype=w13.dtype, device=w13.device), allow_tf32=allow_tf32)
    return dx, dw


class LinearSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, allow_tf32):
        h = linear_swiglu_fwd(x, w13, allow_tf32)
        ctx.save_for_backward(x, w13)
        ctx.allow_tf32 = allow_tf32
        return h

    @staticmethod
    def backward(ctx, dh):
        x, w13 = ctx.saved_tensors
        dx, dw = linear_swiglu_bwd(dh, x, w13, ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.allow_tf32)
        return dx, dw, None


def linear_swiglu(x: torch.Tensor, w13: torch.Tensor, *, allow_tf32: bool = True) -> torch.Tensor:
    """SwiGLU MLP input projection ``silu(x @ W1.T) * (x @ W3.T)`` in one GEMM.

    x [..., K]; w13 [2F, K] stacks the gate weight W1 (rows [0, F)) over the up weight W3
    (rows [F, 2F)). Returns h [..., F] in x's dtype; the [..., 2F] gate/up activations are never
    written. Backward recomputes them (one more GEMM) instead of storing them.
    """
    return LinearSwiGLUFunction.apply(x, w13, allow_tf32)
