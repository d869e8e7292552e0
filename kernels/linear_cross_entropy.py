"""Fused LM head + cross-entropy: ``cross_entropy(x @ W.T, target)`` without the [tokens, V] logits.

x [T, H] (leading dimensions folded into T), W [V, H], target [T]. For a row of logits z = x_i W^T
with target t, label smoothing ls and z-loss weight zl (same definitions as ``cross_entropy``)::

    lse    = log sum_j exp(z_j)
    loss_i = lse - (1 - ls) z_t - ls / V sum_j z_j + zl lse^2          (0 when t == ignore_index)
    dloss_i/dz_j = p_j (1 + 2 zl lse) - (1 - ls) [j == t] - ls / V,    p_j = exp(z_j - lse)

``mean`` divides the sum by the number of non-ignored rows (the loss is 0 when all are ignored),
``sum`` adds the rows, ``none`` returns the per-row losses (fp32).

Forward, one chunk of C tokens at a time (C = ``chunk_size``), through one [C, V] buffer:
  1. buf = x_c W^T                       Triton GEMM (kernels.linear.gemm), logits in x's dtype
  2. one program per row: online softmax over V (running max and sum, fp32), the row's loss,
     then a second sweep of the row (an L2 hit) overwriting buf with dloss/dz (unscaled);
  3. dx_c = buf W                        GEMM into the rows of dx
  4. dW  (+)= buf^T x_c                  GEMM accumulating into an fp32 [V, H] buffer (beta = 1
                                         after the first chunk: fixed chunk order, deterministic)
  then one program reduces the row losses in a fixed order and stores the scale of the gradients
  (1 / #valid rows for ``mean``, 1 for ``sum``).
Backward only scales the stored gradients by dloss * scale (one elementwise Triton kernel), as
Liger-Kernel does. With ``reduction="none"`` the per-row upstream gradients are not known in the
forward, so the forward computes only the losses and the backward reruns the chunk loop with each
row of dloss/dz multiplied by its upstream gradient.

Memory beyond inputs and gradients: the [C, V] logits buffer (bounded by ``chunk_size`` whatever
the token count) and the fp32 [V, H] dW accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DTYPES, check_same_device, check_tensor, interpreting, next_pow2
from .linear import as_matrix, check_linear_inputs, gemm

REDUCTIONS = ("mean", "sum", "none")

# Knobs for the GPU, not measured yet.
#: default tokens per chunk: big enough that the fp32 dW read-modify-write per chunk (8 V H bytes)
#: is small next to the chunk's three GEMMs (6 C V H FLOPs); the buffer is C x V in x's dtype.
DEFAULT_CHUNK = 2048
#: columns per step of the row kernel, and its warps.
ROW_BLOCK_V, ROW_NUM_WARPS = 8192, 16
#: elements per program of the gradient-scaling kernel.
SCALE_BLOCK = 4096


@triton.jit
def _linear_cross_entropy_fwd_kernel(
    logits_ptr,  # [C, V] logits of the chunk (row stride stride_l); overwritten by dloss/dz when HAS_GRAD
    stride_l,
    target_ptr,  # [C] target ids (stride stride_t)
    stride_t,
    loss_ptr,  # [C] fp32 out: per-row loss (0 for ignored rows)
    z_ptr,  # [C] fp32 out: per-row z-loss term zl * lse^2 (STORE_Z)
    row_grad_ptr,  # [C] upstream gradient of each row's loss, stride stride_g (HAS_ROW_GRAD)
    stride_g,
    V, ignore_index, label_smoothing, z_loss,
    HAS_SMOOTHING: tl.constexpr,  # label_smoothing > 0
    HAS_GRAD: tl.constexpr,
    STORE_Z: tl.constexpr,
    HAS_ROW_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    t = tl.load(target_ptr + row * stride_t)
    valid = t != ignore_index
    offs = tl.arange(0, BLOCK_V)

    # sweep 1: online softmax statistics and the sum of the logits (label smoothing)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.zeros([], tl.float32)  # running sum of exp(z - m)
    z_sum = tl.zeros([], tl.float32)  # running sum of z (label smoothing)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(cols < V, z, 0.0), axis=0)
    lse = m + tl.log(s)
    in_range = valid & (t >= 0) & (t < V)
    z_t = tl.load(row_ptr + tl.where(in_range, t, 0), mask=in_range, other=0.0).to(tl.float32)
    z_term = z_loss * lse * lse
    loss = lse - (1.0 - label_smoothing) * z_t - label_smoothing / V * z_sum + z_term
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if STORE_Z:
        tl.store(z_ptr + row, tl.where(valid, z_term, 0.0))

    # sweep 2: dloss/dz in place (zeros for ignored rows), scaled by the row's upstream gradient
    if HAS_GRAD:
        scale = tl.where(valid, 1.0, 0.0)
        if HAS_ROW_GRAD:
            scale = scale * tl.load(row_grad_ptr + row * stride_g).to(tl.float32)
        coef = 1.0 + 2.0 * z_loss * lse
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            z = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) * coef - label_smoothing / V - tl.where(cols == t, 1.0 - label_smoothing, 0.0)
            tl.store(row_ptr + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _linear_cross_entropy_reduce_kernel(
    loss_rows_ptr,  # [T] fp32 per-row losses
    z_rows_ptr,  # [T] fp32 per-row z-loss terms
    target_ptr,  # [T] target ids (stride stride_t)
    stride_t,
    loss_ptr,  # [] fp32 out: the reduced loss
    z_ptr,  # [] fp32 out: the reduced z-loss term
    scale_ptr,  # [1] fp32 out: the gradients' scale (1 / #valid rows for MEAN, else 1)
    T, ignore_index,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    loss = tl.zeros((BLOCK,), dtype=tl.float32)
    z = tl.zeros((BLOCK,), dtype=tl.float32)
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, T, BLOCK):
        rows = start + offs
        mask = rows < T
        loss += tl.load(loss_rows_ptr + rows, mask=mask, other=0.0)
        z += tl.load(z_rows_ptr + rows, mask=mask, other=0.0)
        t = tl.load(target_ptr + rows.to(tl.int64) * stride_t, mask=mask, other=ignore_index)
        count += (mask & (t != ignore_index)).to(tl.int32)
    scale = 1.0
    if MEAN:
        scale = 1.0 / tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32)
    tl.store(loss_ptr, tl.sum(loss, axis=0) * scale)
    tl.store(z_ptr, tl.sum(z, axis=0) * scale)
    tl.store(scale_ptr, scale)


@triton.jit
def _linear_cross_entropy_bwd_kernel(
    src_ptr,  # [n] stored gradient (contiguous)
    dst_ptr,  # [n] out: src * dloss * scale, in dst's dtype (contiguous)
    n,
    dloss_ptr,  # [1] upstream gradient of the loss
    scale_ptr,  # [1] fp32 reduction scale (1 / #valid rows for mean, else 1)
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    factor = tl.load(dloss_ptr).to(tl.float32) * tl.load(scale_ptr)
    src = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (src * factor).to(dst_ptr.dtype.element_ty), mask=mask)


def _check_args(x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size):
    check_linear_inputs(x, weight)
    check_tensor("target", target, dtypes=INDEX_DTYPES)
    check_same_device(x=x, target=target)
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(x.shape[:-1])} (x's leading dimensions), "
                         f"got {tuple(target.shape)}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _chunk_loop(x2, weight, t, ignore_index, label_smoothing, z_loss, chunk, allow_tf32,
                need_dx, need_dw, store_z, row_grad=None):
    """Per-row losses (and z terms) of all T rows; with need_dx / need_dw also dx [T, H] (x's
    dtype) and the fp32 dW [V, H] of sum_i g_i loss_i (g_i = row_grad[i], else 1)."""
    T, H = x2.shape
    V = weight.shape[0]
    dev = x2.device
    loss_rows = torch.empty(T, dtype=torch.float32, device=dev)
    z_rows = torch.empty(T, dtype=torch.float32, device=dev) if store_z else None
    dx = torch.empty((T, H), dtype=x2.dtype, device=dev) if need_dx else None
    dw = (torch.zeros if T == 0 else torch.empty)((V, H), dtype=torch.float32, device=dev) if need_dw else None
    buf = torch.empty((min(chunk, T), V), dtype=x2.dtype, device=dev)
    block_v = min(next_pow2(V), 1024 if interpreting() else ROW_BLOCK_V)
    for i, s in enumerate(range(0, T, chunk)):
        e = min(s + chunk, T)
        logits = gemm(x2[s:e], weight.t(), buf[: e - s], allow_tf32=allow_tf32)
        _linear_cross_entropy_fwd_kernel[(e - s,)](
            logits, logits.stride(0), t[s:e], t.stride(0), loss_rows[s:e],
            loss_rows if z_rows is None else z_rows[s:e],
            loss_rows if row_grad is None else row_grad[s:e], 0 if row_grad is None else row_grad.stride(0),
            V, ignore_index, float(label_smoothing), float(z_loss),
            HAS_SMOOTHING=label_smoothing > 0, HAS_GRAD=need_dx or need_dw, STORE_Z=store_z,
            HAS_ROW_GRAD=row_grad is not None,
            BLOCK_V=block_v, num_warps=ROW_NUM_WARPS if not interpreting() else 1,
        )
        if need_dx:
            gemm(logits, weight, dx[s:e], allow_tf32=allow_tf32)
        if need_dw:
            gemm(logits.t(), x2[s:e], dw, accumulate=i > 0, allow_tf32=allow_tf32)
    return loss_rows, z_rows, dx, dw


def _scaled(src: torch.Tensor, dtype: torch.dtype, dloss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """src * dloss * scale in ``dtype`` (a new tensor; the stored gradient stays intact)."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        _linear_cross_entropy_bwd_kernel[(triton.cdiv(n, SCALE_BLOCK),)](src, out, n, dloss, scale, BLOCK=SCALE_BLOCK)
    return out


def linear_cross_entropy_fwd(x, weight, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                             reduction="mean", chunk_size=None, need_dx=False, need_dw=False, allow_tf32=True):
    """Loss, z-loss term and, for ``mean``/``sum``, the gradients of the loss (unscaled by dloss).

    Returns ``(loss, z, dx, dw, scale)``: loss and z are 0-dim fp32 (``mean``/``sum``) or per-row
    [...] fp32 (``none``); dx [T, H] in x's dtype and dw [V, H] fp32 (None unless requested, and
    always None for ``none``); scale is the fp32 [1] factor the gradients still need (1 / #valid
    rows for ``mean``, else 1).
    """
    _check_args(x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size)
    H = weight.shape[1]
    x2 = as_matrix(x, H)
    t = target.reshape(-1)
    chunk = chunk_size or DEFAULT_CHUNK
    none = reduction == "none"
    loss_rows, z_rows, dx, dw = _chunk_loop(x2, weight, t, ignore_index, label_smoothing, z_loss, chunk, allow_tf32,
                                            need_dx and not none, need_dw and not none, store_z=True)
    if none:
        return loss_rows.view(target.shape), z_rows.view(target.shape), None, None, None
    loss, z = (torch.empty((), dtype=torch.float32, device=x.device) for _ in range(2))
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    _linear_cross_entropy_reduce_kernel[(1,)](loss_rows, z_rows, t, t.stride(0), loss, z, scale, t.numel(),
                                              ignore_index, MEAN=reduction == "mean", BLOCK=1024)
    return loss, z, dx, dw, scale


def linear_cross_entropy_bwd(dloss, saved, weight_dtype, x_shape, ignore_index, label_smoothing, z_loss,
                             chunk_size, reduction, need_dx, need_dw, allow_tf32):
    """(dx, dW) from the forward's stored gradients (``mean``/``sum``: saved = (dx, dw, scale)) or,
    for ``none``, by rerunning the chunk loop with per-row upstream gradients (saved = (x, W, target))."""
    if reduction != "none":
        dx, dw, scale = saved
        return (_scaled(dx, dx.dtype, dloss, scale).view(x_shape) if need_dx else None,
                _scaled(dw, weight_dtype, dloss, scale) if need_dw else None)
    x, weight, target = saved
    x2 = as_matrix(x, weight.shape[1])
    _, _, dx, dw = _chunk_loop(x2, weight, target.reshape(-1), ignore_index, label_smoothing, z_loss,
                               chunk_size or DEFAULT_CHUNK, allow_tf32, need_dx, need_dw, store_z=False,
                               row_grad=dloss.reshape(-1))
    if dw is not None and weight_dtype != torch.float32:
        one = torch.ones(1, dtype=torch.float32, device=dw.device)
        dw = _scaled(dw, weight_dtype, one, one)
    return None if dx is None else dx.view(x_shape), dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size,
                return_z_loss, allow_tf32):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, z, dx, dw, scale = linear_cross_entropy_fwd(x, weight, target, ignore_index, label_smoothing, z_loss,
                                                          reduction, chunk_size, need_dx, need_dw, allow_tf32)
        if reduction == "none":
            ctx.save_for_backward(x, weight, target)
        else:
            ctx.save_for_backward(dx, dw, scale)
        ctx.args = (weight.dtype, x.shape, ignore_index, label_smoothing, z_loss, chunk_size, reduction,
                    need_dx, need_dw, allow_tf32)
        if return_z_loss:
            ctx.mark_non_differentiable(z)
            return loss, z
        return loss

    @staticmethod
    def backward(ctx, dloss, *unused):
        dx, dw = linear_cross_entropy_bwd(dloss, ctx.saved_tensors, *ctx.args)
        return dx, dw, None, None, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                         chunk_size: int | None = None, return_z_loss: bool = False, *, allow_tf32: bool = True):
    """Cross-entropy of the LM head ``x @ weight.T`` against ``target``, never materializing the logits.

    x [..., H] (fp32/fp16/bf16), weight [V, H] in x's dtype, target [...] (int32/int64, x's leading
    shape). Equals ``cross_entropy(linear(x, weight), target, ignore_index, label_smoothing, z_loss,
    reduction)``: loss_i = lse - (1 - ls) z_t - ls/V sum_j z_j + z_loss lse^2 per non-ignored row,
    reduced by ``mean`` (over non-ignored rows; 0 when all are ignored), ``sum`` or ``none``
    (per-row fp32 losses, 0 on ignored rows). Tokens go through in chunks of ``chunk_size``
    (default ``DEFAULT_CHUNK``): extra memory is one [chunk_size, V] buffer plus an fp32 [V, H] dW
    accumulator. For ``mean``/``sum`` the gradients are computed in the forward and backward only
    scales them. Returns the fp32 loss, or ``(loss, z_loss_term)`` when ``return_z_loss`` (the
    z-loss part of the loss, reduced the same way, for logging; not differentiable).
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not needs_grad:
        loss, z, *_ = linear_cross_entropy_fwd(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
                                               chunk_size, allow_tf32=allow_tf32)
        return (loss, z) if return_z_loss else loss
    return LinearCrossEntropyFunction.apply(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
                                            chunk_size, return_z_loss, allow_tf32)
