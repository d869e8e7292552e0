"""Grouped GEMM for Mixture-of-Experts: one linear layer per expert over rows grouped by expert.

``x`` is ``[M, K]`` with the rows of expert ``e`` at ``offsets[e]:offsets[e + 1]`` (as produced by
``moe_sort`` + ``moe_gather``), ``weight`` is ``[E, N, K]`` (PyTorch's ``[out, in]`` per expert).

Forward::

    y[r]  = x[r] @ W_e^T                                   r in rows of e        ([M, N])
    grouped_linear_swiglu, w13 = [E, 2F, K] (gate rows 0:F, up rows F:2F per expert):
    gu[r] = x[r] @ W13_e^T = [g | u],  h[r] = silu(g) * u  (fused epilogue; [M, F], gu is saved)

Backward (``dy`` the gradient of y; for SwiGLU ``dgu = swiglu_bwd(dh, gu)`` first)::

    dx[r] = dy[r] @ W_e                                    same grouped kernel, W_e read as [N, K]
    dW_e  = dy[rows of e]^T @ x[rows of e]                 [N, K]; zero for an expert with no rows

The forward and dx products are one persistent launch: every program walks the tile schedule
(expert, m-tile, n-tile), computed on the device from ``offsets`` (per-expert m-tile counts and
their prefix sum, held in registers; m-tiles of all experts in one grouped-M order as in
``kernels/gemm.py``), so there is no host synchronisation and no per-expert launch. Its grid follows
``GemmSettings.persistent``: min(#SMs, tiles) programs, or one per tile (an upper bound on the tile count, the
programs past the device's count doing nothing) beside NCCL. dW has one program per (expert, n-tile, k-tile) output tile that runs over all of the
expert's rows: no split over rows, no atomics, deterministic. Accumulation is fp32 (``tl.dot``,
tf32 for fp32 inputs on the GPU).
"""

from __future__ import annotations

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import INDEX_DTYPES, check_dot_dtype, check_same_device, check_same_dtype, check_tensor, rows_view
from .device import num_sms
from .launch import next_pow2
from .custom_op import absent, compilable, compiled, define, fake, formula_function, given, register_formula
from .gemm_settings import gemm_settings
from .gemm import GPU_CONFIGS, PLAIN, SWIGLU_FWD, prune_configs
from .swiglu import swiglu_bwd_op, swiglu_bwd_pair


@triton.jit
def _grouped_linear_fwd_kernel(
    a_ptr,        # [M, KR] rows grouped by expert, last dim contiguous
    b_ptr,        # per-expert B_e [KR, NO]: element (k, n) at b_ptr + e*stride_be + k*stride_bk + n*stride_bn
    c_ptr,        # [M, NO] out, contiguous (h of the SwiGLU)
    gu_ptr,       # [M, 2 NO] out: pre-activations [gate | up] (EPILOGUE == SWIGLU_FWD), contiguous
    off_ptr,      # [E + 1] expert row offsets
    M, E, NO, KR,
    stride_am,    # row stride of a
    stride_be, stride_bk, stride_bn,
    up_off,       # offset of the up half inside B_e (SWIGLU_FWD): F rows of w13
    EPILOGUE: tl.constexpr,  # PLAIN or SWIGLU_FWD (kernels.gemm's constants)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    SWIGLU: tl.constexpr = EPILOGUE != 0
    ex = tl.arange(0, BLOCK_E)
    emask = ex < E
    lo = tl.minimum(tl.maximum(tl.load(off_ptr + ex, mask=emask, other=0), 0), M)
    hi = tl.minimum(tl.maximum(tl.load(off_ptr + ex + 1, mask=emask, other=0), lo), M)
    m_tiles = tl.cdiv(hi - lo, BLOCK_M)
    m_end = tl.cumsum(m_tiles, axis=0)
    n_tiles = tl.cdiv(NO, BLOCK_N)
    total_m = tl.sum(m_tiles, axis=0)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    tiles_per_group = GROUP_M * n_tiles
    for tile in range(tl.program_id(0), total_m * n_tiles, tl.num_programs(0)):
        # grouped-M order over the m-tiles of all experts: GROUP_M m-tiles sweep every n-tile
        first_m = (tile // tiles_per_group) * GROUP_M
        group_size = tl.minimum(total_m - first_m, GROUP_M)
        mt = first_m + (tile % tiles_per_group) % group_size
        nt = (tile % tiles_per_group) // group_size
        e = tl.sum((m_end <= mt).to(tl.int32), axis=0)
        sel = ex == e
        row0 = tl.sum(tl.where(sel, lo + (mt - m_end + m_tiles) * BLOCK_M, 0), axis=0)
        row_end = tl.sum(tl.where(sel, hi, 0), axis=0)
        rows = row0 + rm
        rmask = rows < row_end
        cols = nt * BLOCK_N + rn
        cmask = cols < NO
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + e.to(tl.int64) * stride_be + rk[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, KR, BLOCK_K):
            kmask = rk < KR - k0
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if SWIGLU:
                bu = tl.load(b_ptrs + up_off, mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc_up = tl.dot(a, bu, acc_up)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        omask = rmask[:, None] & cmask[None, :]
        if SWIGLU:
            gu = gu_ptr + rows.to(tl.int64)[:, None] * (2 * NO) + cols[None, :]
            tl.store(gu, acc.to(gu_ptr.dtype.element_ty), mask=omask)
            tl.store(gu + NO, acc_up.to(gu_ptr.dtype.element_ty), mask=omask)
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * NO + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=omask)


@triton.jit
def _grouped_linear_dw_kernel(
    dy_ptr,       # [M, N] output gradients grouped by expert, last dim contiguous
    x_ptr,        # [M, K] inputs grouped by expert, last dim contiguous
    dw_ptr,       # [E, N, K] out: weight gradients, contiguous
    off_ptr,      # [E + 1] expert row offsets
    M, N, K,
    stride_dym,   # row stride of dy
    stride_xm,    # row stride of x
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    e = pid // (n_tiles * k_tiles)
    nt = (pid // k_tiles) % n_tiles
    kt = pid % k_tiles
    lo = tl.minimum(tl.maximum(tl.load(off_ptr + e), 0), M)
    hi = tl.minimum(tl.maximum(tl.load(off_ptr + e + 1), lo), M)
    rm = tl.arange(0, BLOCK_M)
    ns = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask = ns < N
    kmask = ks < K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        rows = (m0 + rm).to(tl.int64)
        rmask = rows < hi
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + ns[None, :], mask=rmask[:, None] & nmask[None, :],
                     other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc)
    out = dw_ptr + e.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


#: GPU tile configs (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): the forward/dx kernel
#: tries kernels.gemm's GPU_CONFIGS (GROUP_M 8) with its shared-memory / register pruning (the
#: argument names a_ptr and EPILOGUE match), the dW kernel the list below. Not yet measured
#: on H100/H200: the lead's first tuning knob.
_DW_CONFIGS = [(64, 128, 128, 3, 8), (64, 128, 64, 4, 4), (128, 128, 64, 3, 8)]
#: One fixed config per kernel under the interpreter, whose cost grows with the number of programs
#: and of tile steps: tiles large enough for few steps, small enough that CPU tests cover several.
_INTERP_FWD = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}
_INTERP_DW = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}


def _configs(blocks, **extra):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_stages=st, num_warps=nw)
            for bm, bn, bk, st, nw in blocks]


if interpreting():
    _fwd_kernel, _dw_kernel = _grouped_linear_fwd_kernel, _grouped_linear_dw_kernel
else:
    _fwd_kernel = triton.autotune(
        _configs(GPU_CONFIGS, GROUP_M=8), key=["M", "NO", "KR", "EPILOGUE"],
        prune_configs_by={"early_config_prune": prune_configs})(_grouped_linear_fwd_kernel)
    _dw_kernel = triton.autotune(_configs(_DW_CONFIGS), key=["M", "N", "K"])(_grouped_linear_dw_kernel)


def _grouped_mm(a, w, offsets, b_strides, kr, no, swiglu=False, up_off=0):
    """out[rows of e] = a[rows of e] @ B_e with B_e[k, n] at ``w + e*s0 + k*s1 + n*s2`` ([M, no]);
    with ``swiglu`` also the pre-activations ``gu`` ([M, 2 no]) and out = silu(gate) * up."""
    M, E = a.shape[0], w.shape[0]
    out = torch.empty((M, no), dtype=a.dtype, device=a.device)
    gu = torch.empty((M, 2 * no), dtype=a.dtype, device=a.device) if swiglu else out
    n_sm = num_sms(a.device.index if a.is_cuda else None)

    def grid(meta):  # the tile count is known on the device only: at most each expert's last m-tile more
        tiles = (triton.cdiv(M, meta["BLOCK_M"]) + E) * triton.cdiv(no, meta["BLOCK_N"])
        return (max(1, min(n_sm, tiles) if gemm_settings().persistent else tiles),)

    _fwd_kernel[grid](a, w, out, gu, offsets, M, E, no, kr, a.stride(0), *b_strides, up_off,
                      EPILOGUE=SWIGLU_FWD if swiglu else PLAIN, BLOCK_E=next_pow2(E),
                      **(_INTERP_FWD if interpreting() else {}))
    return out, gu


def _grouped_dw(dy, x, offsets, num_experts, dtype):
    """dW_e = dy[rows of e]^T @ x[rows of e]: ``[E, N, K]`` in ``dtype``."""
    M, N = dy.shape
    K = x.shape[1]
    dw = torch.empty((num_experts, N, K), dtype=dtype, device=x.device)

    def grid(meta):
        return (num_experts * triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(K, meta["BLOCK_K"]),)

    _dw_kernel[grid](dy, x, dw, offsets, M, N, K, dy.stride(0), x.stride(0), **(_INTERP_DW if interpreting() else {}))
    return dw


def _check_inputs(x, weight, expert_offsets, wname):
    check_tensor("x", x, ndim=2)
    check_tensor(wname, weight, ndim=3)
    check_tensor("expert_offsets", expert_offsets, dtypes=INDEX_DTYPES, ndim=1)
    check_same_device(x=x, **{wname: weight}, expert_offsets=expert_offsets)
    check_same_dtype(x=x, **{wname: weight})
    check_dot_dtype("x", x)
    E, _, K = weight.shape
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} features but {wname} {tuple(weight.shape)} expects K={K}")
    if expert_offsets.shape[0] != E + 1:
        raise ValueError(f"expert_offsets must have E+1 = {E + 1} entries for {E} experts, "
                         f"got {expert_offsets.shape[0]}")


def grouped_linear_fwd(x, weight, expert_offsets):
    """``y[rows of e] = x[rows of e] @ weight[e].T``: ``[M, N]``."""
    _check_inputs(x, weight, expert_offsets, "weight")
    x = rows_view(x, x.shape[1])
    _, N, K = weight.shape
    return _grouped_mm(x, weight, expert_offsets, (weight.stride(0), weight.stride(2), weight.stride(1)), K, N)[0]


def grouped_linear_bwd(dy, x, weight, expert_offsets, need_dx=True, need_dw=True):
    """(dx [M, K], dW [E, N, K]) of :func:`grouped_linear`; either is None when not needed."""
    dy = rows_view(dy, dy.shape[1])
    x = rows_view(x, x.shape[1])
    E, N, K = weight.shape
    dx = dw = None
    if need_dx:
        dx = _grouped_mm(dy, weight, expert_offsets, (weight.stride(0), weight.stride(1), weight.stride(2)), N, K)[0]
    if need_dw:
        dw = _grouped_dw(dy, x, expert_offsets, E, weight.dtype)
    return dx, dw


def grouped_linear_swiglu_fwd(x, w13, expert_offsets):
    """(h [M, F], gu [M, 2F]): ``gu = x @ w13[e].T`` per expert and ``h = silu(gu[:, :F]) * gu[:, F:]``."""
    _check_inputs(x, w13, expert_offsets, "w13")
    E, F2, K = w13.shape
    if F2 % 2:
        raise ValueError(f"w13 must be [E, 2F, K] (gate rows then up rows), got odd dim 1 in {tuple(w13.shape)}")
    x = rows_view(x, K)
    return _grouped_mm(x, w13, expert_offsets, (w13.stride(0), w13.stride(2), w13.stride(1)), K, F2 // 2,
                       swiglu=True, up_off=(F2 // 2) * w13.stride(1))


def _grouped_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_grads(ctx, dy, x, weight, offsets, bwd):
    """``(dx, dweight, None)`` by ``bwd`` (the launcher or the backward op) from the gradient ``dy`` of
    the grouped GEMM's output."""
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = bwd(dy, x, weight, offsets, need_dx, need_dw)
    return given(dx, need_dx), given(dw, need_dw), None


def _grouped_linear_backward(ctx, dy, *, bwd=grouped_linear_bwd):
    """The gradients by ``bwd``: the launcher eagerly, the backward op under torch.compile."""
    return _grouped_grads(ctx, dy, *ctx.saved_tensors, bwd)


GroupedLinearFunction = formula_function("GroupedLinearFunction", grouped_linear_fwd, _grouped_linear_setup, _grouped_linear_backward)


def _grouped_linear_swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _grouped_linear_swiglu_backward(ctx, dh, _dgu=None, *, swiglu_bwd=swiglu_bwd_pair, bwd=grouped_linear_bwd):
    """The gradients through the stored pre-activations ``gu``: the packed SwiGLU backward, then the grouped
    GEMM's, by the unchecked launchers eagerly and the backward ops under torch.compile."""
    x, w13, offsets, gu = ctx.saved_tensors
    dgu, _ = swiglu_bwd(dh, gu, None)
    return _grouped_grads(ctx, dgu, x, w13, offsets, bwd)


class GroupedLinearSwiGLUFunction(torch.autograd.Function):
    """The launchers with :func:`_grouped_linear_swiglu_setup` and :func:`_grouped_linear_swiglu_backward`,
    the custom op's formula too; returns ``h`` (the op returns ``(h, gu)``)."""

    @staticmethod
    def forward(ctx, *inputs):
        h, gu = grouped_linear_swiglu_fwd(*inputs)
        _grouped_linear_swiglu_setup(ctx, inputs, (h, gu))
        return h

    @staticmethod
    def backward(ctx, dh):
        return _grouped_linear_swiglu_backward(ctx, dh)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::grouped_linear_fwd", mutates_args=())
def grouped_linear_fwd_op(x: Tensor, weight: Tensor, expert_offsets: Tensor) -> Tensor:
    """:func:`kernels.grouped_linear.grouped_linear_fwd`."""
    return grouped_linear_fwd(x, weight, expert_offsets)


@fake(grouped_linear_fwd_op)
def _(x, weight, expert_offsets):
    return x.new_empty((x.shape[0], weight.shape[1]))


@define("tritonllm::grouped_linear_bwd", mutates_args=())
def grouped_linear_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, expert_offsets: Tensor, need_dx: bool,
                          need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of :func:`kernels.grouped_linear.grouped_linear_bwd`, absent where not needed."""
    dx, dw = grouped_linear_bwd(dy, x, weight, expert_offsets, need_dx, need_dw)
    return (dx if dx is not None else absent(x)), (dw if dw is not None else absent(x))


@fake(grouped_linear_bwd_op)
def _(dy, x, weight, expert_offsets, need_dx, need_dw):
    return (dy.new_empty((dy.shape[0], weight.shape[2])) if need_dx else absent(x),
            weight.new_empty(weight.shape) if need_dw else absent(x))


register_formula(grouped_linear_fwd_op, _grouped_linear_setup, _grouped_linear_backward, bwd=grouped_linear_bwd_op)


@compiled("grouped_linear")
def _compiled_grouped_linear(x: Tensor, weight: Tensor, expert_offsets: Tensor) -> Tensor:
    return grouped_linear_fwd_op(x, weight, expert_offsets)


@define("tritonllm::grouped_linear_swiglu_fwd", mutates_args=())
def grouped_linear_swiglu_fwd_op(x: Tensor, w13: Tensor, expert_offsets: Tensor) -> tuple[Tensor, Tensor]:
    """``(h, gu)`` of :func:`kernels.grouped_linear.grouped_linear_swiglu_fwd` (the backward is the packed
    swiglu_bwd op, then grouped_linear_bwd)."""
    return grouped_linear_swiglu_fwd(x, w13, expert_offsets)


@fake(grouped_linear_swiglu_fwd_op)
def _(x, w13, expert_offsets):
    M, two_f = x.shape[0], w13.shape[1]
    return x.new_empty((M, two_f // 2)), x.new_empty((M, two_f))


register_formula(grouped_linear_swiglu_fwd_op, _grouped_linear_swiglu_setup, _grouped_linear_swiglu_backward,
                 swiglu_bwd=swiglu_bwd_op, bwd=grouped_linear_bwd_op)


@compiled("grouped_linear_swiglu")
def _compiled_grouped_linear_swiglu(x: Tensor, w13: Tensor, expert_offsets: Tensor) -> Tensor:
    return grouped_linear_swiglu_fwd_op(x, w13, expert_offsets)[0]


@compilable
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert linear layer over rows grouped by expert.

    Args:
        x: ``[M, K]``, rows of expert ``e`` at ``expert_offsets[e]:expert_offsets[e + 1]``.
        weight: ``[E, N, K]`` (``[out, in]`` per expert), same dtype as ``x``.
        expert_offsets: ``[E + 1]`` int32/int64 on x's device, non-decreasing from 0 to ``M``
            (``moe_sort(...).expert_offsets``; not checked on the device).

    Returns ``y [M, N]`` with ``y[r] = x[r] @ weight[e].T``; differentiable in ``x`` and ``weight``
    (an expert without rows gets a zero gradient).
    """
    return GroupedLinearFunction.apply(x, weight, expert_offsets)


@compilable
def grouped_linear_swiglu(x: torch.Tensor, w13: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert SwiGLU projection ``silu(x @ W_gate[e].T) * (x @ W_up[e].T)``, one grouped GEMM.

    ``w13`` is ``[E, 2F, K]``: per expert the gate rows ``0:F`` then the up rows ``F:2F``; ``x`` and
    ``expert_offsets`` as in :func:`grouped_linear`. Returns ``[M, F]``. The SwiGLU is the GEMM's
    epilogue; the pre-activations ``[M, 2F]`` are saved for the backward.
    """
    return GroupedLinearSwiGLUFunction.apply(x, w13, expert_offsets)
