"""LoRA: a frozen (packed) linear layer plus low-rank updates on segments of its output columns.

Shapes: x [M, K] (leading dimensions folded into M), W [N, K] (frozen), bias [N], adapters
j = 0..S-1 each on the output columns ``[start_j, start_j + n_j)`` with A_j [r, K] (stacked as
``a`` [S, r, K]) and B_j [n_j, r] (stacked by rows as ``b`` [sum n_j, r]), scale s = alpha / r,
dropout probability p on the adapters' input (keep mask m, ``xd = x * m / (1 - p)``; ``xd = x``
when p = 0)::

    forward:   y = x W^T + bias (+ residual)
               U = s * xd A^T                      [M, S r]   (U_j = its columns j r .. j r + r)
               y[:, seg_j] += U_j B_j^T                        (GEMM accumulating into y's columns)
    backward:  G_j = s * dy[:, seg_j] B_j          [M, r]     (G = [G_0 .. G_{S-1}] [M, S r])
               dA = G^T xd                         [S r, K]
               dB_j = dy[:, seg_j]^T U_j           [n_j, r]
               dx = dy W + (G A) * m / (1 - p)     (the adapters' part through the dropout mask)
               dW = dy^T x, dbias = sum of dy's rows (only when W or bias needs a gradient)

With ``fp8`` the frozen layer's own products (``x W^T`` and ``dy W``; ``dy^T x`` when W is trained) are
:mod:`kernels.fp8_linear`'s, on e4m3 operands scaled per row, the adapters' stay in x's dtype.

The GEMMs with a long output (``y``, ``dx``, ``dA``, ``dB``) are :func:`kernels.gemm.gemm`; the
two with an ``r``-wide output (``U`` and ``G``) are ``_lora_down_kernel``: one program per
``BLOCK_M`` rows holds the whole ``[BLOCK_M, r]`` output tile and sweeps K, scaling by ``s`` in
its epilogue (fp32 accumulation). Dropout is ``_dropout_kernel``: the keep mask of element
``(row, col)`` is ``uniform(philox(seed, col, row)) >= p`` with ``seed`` read from a device tensor
(drawn on the device per call, so a step captured in a CUDA graph draws a new mask per replay);
the backward regenerates the same mask from the same seed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_dot_dtype, check_same_device, check_same_dtype, check_tensor, needs_grad
from .device import smem_budget
from .launch import next_pow2
from .custom_op import absent, compilable, compiled, define, fake, formula_function, given, n_rows, register_formula
from .fp8 import quantize
from .fp8_linear import E4M3, check_fp8_device, fp8_linear_bwd, fp8_linear_fwd
from .gemm import SMEM_RESERVE, as_matrix, gemm
from .linear import linear_bwd, linear_fwd


@triton.jit
def _lora_down_kernel(
    a_ptr,  # [M, K] left operand, strides (stride_am, stride_ak)
    b_ptr,  # [K, R] right operand, strides (stride_bk, stride_br)
    c_ptr,  # [M, R] output = alpha * a @ b, strides (stride_cm, stride_cr)
    M, K, R,
    stride_am, stride_ak, stride_bk, stride_br, stride_cm, stride_cr,
    alpha,  # fp32 scale applied to the fp32 accumulator
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input_precision: "tf32" or "ieee" (fp32 inputs only)
):
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        a = tl.load(a_rows + ks.to(tl.int64)[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + ks.to(tl.int64)[:, None] * stride_bk + rr[None, :] * stride_br,
                    mask=k_ok[:, None] & (rr < R)[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = (acc * alpha).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rr[None, :] * stride_cr, c,
             mask=row_ok[:, None] & (rr < R)[None, :])


@triton.jit
def _dropout_kernel(
    x_ptr,  # [M, K] input, row stride stride_xm, unit column stride
    out_ptr,  # [M, K] output, row stride stride_om, unit column stride
    seed_ptr,  # [1] int64 seed on the device
    M, K, stride_xm, stride_om,
    p,  # drop probability in [0, 1)
    ACCUMULATE: tl.constexpr,  # out += dropout(x) instead of out = dropout(x)
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    seed = tl.load(seed_ptr)
    zero = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.uint32)
    bits, _, _, _ = tl.philox(seed, rk.to(tl.uint32)[None, :] + zero, rm.to(tl.uint32)[:, None] + zero, zero, zero)
    keep = tl.uint_to_uniform_float(bits) >= p
    x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.where(keep, x / (1.0 - p), 0.0)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rk[None, :]
    if ACCUMULATE:
        y += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def lora_down(a: torch.Tensor, b: torch.Tensor, alpha: float, out: torch.Tensor | None = None,
              allow_tf32: bool = True) -> torch.Tensor:
    """``alpha * a @ b`` for a [M, K] and b [K, R] with a narrow R (at most 256), any strides;
    written into ``out`` [M, R] (any strides) when given."""
    M, K = a.shape
    R = b.shape[1]
    if R > 256:
        raise ValueError(f"lora_down: the output width {R} (adapters x rank) exceeds 256")
    if out is None:
        out = torch.empty((M, R), dtype=a.dtype, device=a.device)
    if M == 0:
        return out
    block_r = max(16, next_pow2(R))
    # Fixed tiles (not yet tuned on a GPU): 64-row tiles keep the fp32 accumulator of a 256-wide
    # output at 64 KiB of registers per program.
    block_m = 64 if (block_r > 128 or interpreting()) else 128
    block_k = 32 if interpreting() else 64
    precision = "ieee" if (a.dtype == torch.float32 and not allow_tf32) else "tf32"
    launch = {} if interpreting() else {"num_warps": 4 if block_m == 64 else 8,
                                        "num_stages": lora_down_stages(block_m, block_k, block_r, a.element_size())}
    _lora_down_kernel[(triton.cdiv(M, block_m),)](
        a, b, out, M, K, R, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        float(alpha), BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, PRECISION=precision, **launch)
    return out


def lora_down_stages(block_m: int, block_k: int, block_r: int, element_size: int) -> int:
    """Software-pipeline stages of :func:`lora_down`'s K loop: 3, or as many as the A [block_m, block_k]
    and B [block_k, block_r] tiles of one stage fit in :func:`smem_budget` (fp32 at R = 256 needs 80 KiB
    a stage: two on an H100, one on a GPU with 99 KiB per block)."""
    per_stage = (block_m + block_r) * block_k * element_size
    return max(1, min(3, smem_budget(SMEM_RESERVE) // per_stage))


def dropout(x: torch.Tensor, p: float, seed: torch.Tensor, out: torch.Tensor | None = None,
            accumulate: bool = False) -> torch.Tensor:
    """``x * m / (1 - p)`` for x [M, K] (unit column stride), the keep mask m drawn from ``seed``
    (a 1-element int64 device tensor); into ``out`` (``out +=`` with ``accumulate``)."""
    M, K = x.shape
    if out is None:
        out = torch.empty((M, K), dtype=x.dtype, device=x.device)
    if M == 0 or K == 0:
        return out
    block_m, block_k = 32, 128
    _dropout_kernel[(triton.cdiv(M, block_m), triton.cdiv(K, block_k))](
        x, out, seed, M, K, x.stride(0), out.stride(0), float(p), ACCUMULATE=accumulate,
        BLOCK_M=block_m, BLOCK_K=block_k)
    return out


def check_lora_args(x, weight, bias, a, b, segments, scale, p, seed, residual) -> None:
    check_tensor("x", x, min_ndim=1)
    check_tensor("weight", weight, ndim=2)
    check_tensor("lora_a", a, ndim=3)
    check_tensor("lora_b", b, ndim=2)
    check_same_device(x=x, weight=weight, lora_a=a, lora_b=b)
    check_same_dtype(x=x, weight=weight, lora_a=a, lora_b=b)
    check_dot_dtype("x", x)
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: its second dimension must equal x's last "
                         f"dimension K={x.shape[-1]}")
    S, r, ka = a.shape
    if ka != K or S != len(segments) or S == 0:
        raise ValueError(f"lora_a must have shape (len(segments)={len(segments)} > 0, r, K={K}), "
                         f"got {tuple(a.shape)}")
    if S * r > 256:
        raise ValueError(f"lora_a: {S} adapters of rank {r} exceed the 256 columns lora_down supports")
    rows = 0
    for j, (start, size) in enumerate(segments):
        if start < 0 or size < 1 or start + size > N:
            raise ValueError(f"segments[{j}] = {(start, size)} is not a column range of the {N} outputs")
        rows += size
    if tuple(b.shape) != (rows, r):
        raise ValueError(f"lora_b must have shape ({rows}, {r}) (the segments' widths x rank), got {tuple(b.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    if p > 0:
        if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError("seed must be a 1-element int64 tensor when dropout > 0")
        check_same_device(x=x, seed=seed)
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], N):
        raise ValueError(f"residual must have the output's shape {(*x.shape[:-1], N)}, got {tuple(residual.shape)}")


def _b_rows(segments) -> list[int]:
    """First row of each adapter's B_j in the stacked ``lora_b``."""
    offs, total = [], 0
    for _, size in segments:
        offs.append(total)
        total += size
    return offs


def lora_forward(x, weight, bias, residual, a, b, segments, scale, p, seed, allow_tf32, fp8=False):
    """``(y [..., N], xd, U)`` of the forward for x [..., K] (viewed as x2 [M, K]): base GEMM (``fp8``: on
    fp8 operands), then the adapters' GEMMs accumulating into y's column segments; ``xd [M, K]`` the
    dropped-out input (None without dropout), ``U [M, S r]`` the scaled down projection. ``segments``:
    ``(start, width)`` pairs."""
    N, K = weight.shape
    S, r, _ = a.shape
    x2 = as_matrix(x, K)
    res2 = None if residual is None else as_matrix(residual, N)
    y = fp8_linear_fwd(x2, weight, bias, res2)[0] if fp8 else linear_fwd(x2, weight, bias, res2, allow_tf32)
    xd = dropout(x2, p, seed) if p > 0 else None
    u = lora_down(x2 if xd is None else xd, a.reshape(S * r, K).t(), scale, allow_tf32=allow_tf32)
    for j, ((start, size), row) in enumerate(zip(segments, _b_rows(segments))):
        gemm(u[:, j * r:(j + 1) * r], b[row:row + size].t(), y[:, start:start + size], accumulate=True,
             allow_tf32=allow_tf32)
    return y.view(*x.shape[:-1], N), xd, u


def _fp8_base_bwd(dy2, x2, weight, need_x, need_w, need_bias):
    """(dx, dW, dbias) of the frozen layer's fp8 product: W's per-column copy for dx (and x's for dW) quantized
    here, from the weight and the input the backward keeps anyway."""
    _, _, xt, sxt = quantize(x2, E4M3, rows=False, cols=need_w)
    _, _, wt, swt = quantize(weight, E4M3, rows=False, cols=need_x)
    return fp8_linear_bwd(dy2, xt, sxt, wt, swt, need_x, need_w, need_bias, E4M3, weight.dtype)


def lora_backward(dy, x, xd, weight, a, b, u, seed, segments, scale, p, allow_tf32, need_x, need_w, need_bias,
                  need_a, need_b, fp8=False):
    """``(dx [x's shape], dweight, dbias, dlora_a, dlora_b)`` from dy [..., N], None where ``need_*`` (x,
    weight, bias, lora_a, lora_b) says not needed; ``xd`` is the dropped-out input (None without dropout),
    ``segments`` the ``(start, width)`` pairs; ``fp8``: the frozen layer's products on fp8 operands."""
    N, K = weight.shape
    S, r, _ = a.shape
    x2 = as_matrix(x, K)
    dy2 = as_matrix(dy, N)
    rows = _b_rows(segments)
    g = torch.empty((dy2.shape[0], S * r), dtype=dy.dtype, device=dy.device)
    for j, ((start, size), row) in enumerate(zip(segments, rows)):
        lora_down(dy2[:, start:start + size], b[row:row + size], scale, out=g[:, j * r:(j + 1) * r],
                  allow_tf32=allow_tf32)
    da = db = None
    if need_a:
        da = gemm(g.t(), x2 if xd is None else xd, torch.empty((S * r, K), dtype=a.dtype, device=a.device),
                  allow_tf32=allow_tf32).view(S, r, K)
    if need_b:
        db = torch.empty_like(b)
        for j, ((start, size), row) in enumerate(zip(segments, rows)):
            gemm(dy2[:, start:start + size].t(), u[:, j * r:(j + 1) * r], db[row:row + size],
                 allow_tf32=allow_tf32)
    dx, dw, dbias = (_fp8_base_bwd(dy2, x2, weight, need_x, need_w, need_bias) if fp8
                     else linear_bwd(dy2, x2, weight, need_x, need_w, need_bias, allow_tf32))
    if need_x:
        dx = dx.view(-1, K)
        if p > 0:
            dropout(gemm(g, a.reshape(S * r, K), torch.empty_like(dx), allow_tf32=allow_tf32), p, seed, out=dx,
                    accumulate=True)
        else:
            gemm(g, a.reshape(S * r, K), dx, accumulate=True, allow_tf32=allow_tf32)
        dx = dx.view(x.shape)
    return dx, dw, dbias, da, db


def _lora_setup(ctx, inputs, output):
    """Of the forward's inputs and ``(y, xd, u)``: saves x, the weight, the adapters, ``u`` and, with dropout,
    ``xd`` and the seed; keeps ``segments`` as the forward got them (``(start, width)`` pairs eagerly,
    the op's flattened list, which the backward op takes, under torch.compile) and the scalars."""
    x, weight, _, _, a, b, segments, scale, p, seed, allow_tf32, fp8 = inputs
    ctx.options = (segments, scale, p, allow_tf32, fp8)
    _, xd, u = output
    ctx.save_for_backward(x, xd if p > 0 else None, weight, a, b, u, seed if p > 0 else None)


def _lora_backward(ctx, dy, _dxd=None, _du=None, *, bwd=lora_backward):
    """``(dx, dweight, dbias, dresidual, dlora_a, dlora_b, None x 5)`` by ``bwd``: :func:`lora_backward`
    eagerly, the backward op under torch.compile (``dresidual`` is ``dy`` itself)."""
    x, xd, weight, a, b, u, seed = ctx.saved_tensors
    segments, scale, p, allow_tf32, fp8 = ctx.options
    need_x, need_w, need_bias, need_res, need_a, need_b = ctx.needs_input_grad[:6]
    dx, dw, dbias, da, db = bwd(dy, x, xd, weight, a, b, u, seed, segments, scale, p, allow_tf32, need_x, need_w,
                                need_bias, need_a, need_b, fp8)
    return (given(dx, need_x), given(dw, need_w), given(dbias, need_bias), (dy if need_res else None),
            given(da, need_a), given(db, need_b), None, None, None, None, None, None)


#: :func:`lora_forward` with :func:`_lora_setup` and :func:`_lora_backward`, the custom op's formula too;
#: returns ``y`` (the op returns ``(y, xd, u)``)
LoRALinearFunction = formula_function("LoRALinearFunction", lora_forward, _lora_setup, _lora_backward, first=True)


def _segment_pairs(segments: list[int]) -> tuple[tuple[int, int], ...]:
    """``(start, width)`` pairs from their flattened list (an op's schema holds ``int[]``)."""
    return tuple(zip(segments[::2], segments[1::2]))


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::lora_linear_fwd", mutates_args=())
def lora_linear_fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], lora_a: Tensor,
                       lora_b: Tensor, segments: list[int], scale: float, dropout_p: float, seed: Optional[Tensor],
                       allow_tf32: bool, fp8: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, xd or absent, u)`` of :func:`kernels.lora.lora_forward`; ``segments`` is the flattened list of
    ``(start, width)`` pairs."""
    y, xd, u = lora_forward(x, weight, bias, residual, lora_a, lora_b, _segment_pairs(segments), scale, dropout_p,
                            seed, allow_tf32, fp8)
    return y, (xd if xd is not None else absent(x)), u


@fake(lora_linear_fwd_op)
def _(x, weight, bias, residual, lora_a, lora_b, segments, scale, dropout_p, seed, allow_tf32, fp8):
    (S, r, K), M = lora_a.shape, n_rows(x)
    return (x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((M, K)) if dropout_p > 0 else absent(x),
            x.new_empty((M, S * r)))


@define("tritonllm::lora_linear_bwd", mutates_args=())
def lora_linear_bwd_op(dy: Tensor, x: Tensor, xd: Optional[Tensor], weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                       u: Tensor, seed: Optional[Tensor], segments: list[int], scale: float, dropout_p: float,
                       allow_tf32: bool, need_x: bool, need_w: bool, need_bias: bool, need_a: bool,
                       need_b: bool, fp8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias, dlora_a, dlora_b)`` of :func:`kernels.lora.lora_backward`, absent where not needed."""
    grads = lora_backward(dy, x, xd, weight, lora_a, lora_b, u, seed, _segment_pairs(segments), scale, dropout_p,
                          allow_tf32, need_x, need_w, need_bias, need_a, need_b, fp8)
    dx, dw, db, da, dlb = (g if g is not None else absent(x) for g in grads)
    return dx, dw, db, da, dlb


@fake(lora_linear_bwd_op)
def _(dy, x, xd, weight, lora_a, lora_b, u, seed, segments, scale, dropout_p, allow_tf32, need_x, need_w, need_bias,
      need_a, need_b, fp8):
    like = ((x, x.shape, need_x), (weight, weight.shape, need_w), (weight, weight.shape[:1], need_bias),
            (lora_a, lora_a.shape, need_a), (lora_b, lora_b.shape, need_b))
    return tuple(t.new_empty(shape) if needed else absent(x) for t, shape, needed in like)


register_formula(lora_linear_fwd_op, _lora_setup, _lora_backward, bwd=lora_linear_bwd_op)


@compiled("lora_linear")
def _compiled_lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, segments,
                          scale: float, *, dropout_p: float = 0.0, seed: Tensor | None = None, residual: Tensor | None = None,
                          allow_tf32: bool = True, fp8: bool = False) -> Tensor:
    pairs = tuple((int(s), int(n)) for s, n in segments)
    check_lora_args(x, weight, bias, lora_a, lora_b, pairs, scale, float(dropout_p), seed, residual)
    if fp8:
        check_fp8_device(x)
    return lora_linear_fwd_op(x, weight, bias, residual, lora_a, lora_b, [v for pair in pairs for v in pair],
                              float(scale), float(dropout_p), seed, allow_tf32, fp8)[0]


@compilable
def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, segments, scale: float, *, dropout_p: float = 0.0,
                seed: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                allow_tf32: bool = True, fp8: bool = False) -> torch.Tensor:
    """``x W^T + bias (+ residual)`` with LoRA updates ``s * dropout(x) A_j^T B_j^T`` added to the
    output columns ``segments[j] = (start_j, n_j)``; the math is in this module's docstring.

    x [..., K]; weight [N, K]; bias [N] or None; lora_a [S, r, K]; lora_b [sum n_j, r] (B_j
    stacked by rows in segment order); scale s (``alpha / r``); ``dropout_p`` with ``seed`` (a
    1-element int64 tensor on x's device, needed when ``dropout_p > 0``). All tensors in x's
    floating dtype; returns [..., N]. Gradients flow to every input that requires one (a frozen
    ``weight`` gets none and costs no GEMM). ``fp8``: the frozen layer's products on e4m3 operands
    scaled per row (:mod:`kernels.fp8_linear`; fp8 tensor cores or the interpreter), the adapters' in x's dtype.
    """
    segments = tuple((int(s), int(n)) for s, n in segments)
    check_lora_args(x, weight, bias, lora_a, lora_b, segments, scale, float(dropout_p), seed, residual)
    if fp8:
        check_fp8_device(x)
    if needs_grad(x, weight, bias, residual, lora_a, lora_b):
        return LoRALinearFunction.apply(x, weight, bias, residual, lora_a, lora_b, segments, float(scale),
                                        float(dropout_p), seed, allow_tf32, fp8)
    return lora_forward(x, weight, bias, residual, lora_a, lora_b, segments, float(scale), float(dropout_p), seed,
                        allow_tf32, fp8)[0]
