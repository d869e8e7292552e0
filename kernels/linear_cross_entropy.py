"""Fused LM head + cross-entropy: ``cross_entropy(x @ W.T, target)`` without the [tokens, V] logits.

x [T, H] (leading dimensions folded into T), W [V, H], target [T]. For a row of logits z = x_i W^T
with target t, label smoothing ls and z-loss weight zl (same definitions as ``cross_entropy``)::

    lse    = log sum_j exp(z_j)
    loss_i = lse - (1 - ls) z_t - ls / V sum_j z_j + zl lse^2          (0 when t == ignore_index)
    dloss_i/dz_j = p_j (1 + 2 zl lse) - (1 - ls) [j == t] - ls / V,    p_j = exp(z_j - lse)

With ``softcap`` c > 0 the logits are soft-capped first, z = c tanh(l / c) of the GEMM's l = x_i W^T
(Gemma 2, modded-nanogpt), and the row's gradient is taken through the cap::

    dloss_i/dl_j = dloss_i/dz_j (1 - (z_j / c)^2)

``mean`` divides the sum by the number of non-ignored rows (the loss is 0 when all are ignored),
``sum`` adds the rows, ``none`` returns the per-row losses (fp32).

Forward, one chunk of C tokens at a time (C = ``chunk_size``), through one [C, V] buffer:
  1. buf = x_c W^T                       Triton GEMM (kernels.gemm.gemm), logits in x's dtype
  2. one program per row: the cap (fp32) on each logit as it is read, softmax statistics over V (the whole row in registers when V fits, else
     an online max/sum over blocks), the row's loss, then dloss/dz (unscaled) written over buf;
  3. dx_c = buf W                        GEMM into the rows of dx (split along V when C gives too
                                         few output tiles to fill the GPU)
  4. dW  (+)= buf^T x_c                  GEMM accumulating into dW (beta = 1 after the first chunk:
                                         fixed chunk order, deterministic), in W's dtype like
                                         Liger-Kernel, or in fp32 with ``DW_FP32``
  then one program reduces the row losses in a fixed order and stores the scale of the gradients
  (1 / #valid rows for ``mean``, 1 for ``sum``).
FP8 head (``fp8=True``): step 1 multiplies x and W quantized per row to e4m3 (scales applied in
the GEMM's epilogue), step 2 also writes dloss/dz quantized per row to e5m2 (fp32 row maximum, one
more read of the row when it does not fit in registers) and step 3 multiplies that by W^T quantized
to e4m3 per column of W; step 4 is unchanged (x's dtype).
Backward only scales the stored gradients by dloss * scale (one elementwise Triton kernel per
tensor), as Liger-Kernel does; with ``GRAD_IN_PLACE`` in place, so the returned gradients are the
forward's buffers (a second backward through a retained graph rescales them again, by the ratio
of the new factor to the old). With ``reduction="none"`` the per-row upstream gradients are not
known in the forward, so the forward computes only the losses and the backward reruns the chunk
loop with each row of dloss/dz multiplied by its upstream gradient.

Memory beyond inputs and gradients: the [C, V] logits buffer, the dx split partials (fp32
[splits, C, H]) and, with ``DW_FP32``, an fp32 [V, H] dW accumulator. The default C keeps the
buffer and partials within Liger-Kernel's logits chunk (next_pow2(T / ceil(V / H)) rows of V).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import INDEX_DTYPES, check_same_device, check_tensor, needs_grad
from .device import num_sms
from .launch import Launch, Plans, next_pow2
from .custom_op import absent, compilable, compiled, define, fake, given, n_rows, register_formula
from .fp8 import FP8_MAX, fp8_saturate, fp8_scales, quantize_into
from .gemm import as_matrix, gemm, split_fill, split_k_for
from .linear import check_linear_inputs
from .softcap import check_cap, softcap_math

REDUCTIONS = ("mean", "sum", "none")

# Knobs for the GPU, timed by scripts/tune_linear.py (docs/perf/history.md, issue 3).
#: bytes of the [chunk, V] logits buffer when ``chunk_size`` is None: the tokens go through in the fewest
#: chunks of equal size (a multiple of 64 tokens) whose buffer fits (:func:`chunk_for`). None: Liger-Kernel's
#: extra memory (:func:`default_chunk`). Fewer chunks are faster: each chunk after the first adds a
#: read-modify-write of dW (4 V H bytes in bf16), and a chunk of few tokens under-fills the dx GEMM.
#: 1 GiB: measured on an H100 at 16384x768x32000 fwd+bwd (one chunk) 4.93 ms, peak 1.12 GB, against 5.82 ms
#: (0.23 GB) at chunks of 2048 tokens, 5.39 at 4096 and 8192, and 9.54 (0.106 GB) at Liger's memory
#: (docs/perf/history.md); torch.compile's unfused head takes 2.1 GB there.
CHUNK_BYTES: int | None = 1 << 30
#: default_chunk: the least share of the SMs the dx GEMM's split programs may fill when memory caps
#: the number of splits
MIN_DX_FILL = 0.75
#: accumulate dW over the chunks in an fp32 [V, H] buffer (one rounding at the end, 2 V H bytes
#: more memory) instead of in W's dtype (one rounding per chunk, as Liger-Kernel does)
DW_FP32 = False
#: backward scales the stored gradients in place and returns them (no second copy of dx and dW
#: alive during the backward) instead of writing scaled copies
GRAD_IN_PLACE = True
#: rows of at most this many logits (rounded up to a power of two) are held in registers by the
#: row kernel: one read and one write of the row instead of two reads and a write
ROW_SINGLE_PASS_MAX_V = 32768
#: columns per step of the row kernel for longer rows, and its warps.
ROW_BLOCK_V, ROW_NUM_WARPS = 8192, 16
#: elements per program of the gradient-scaling kernel.
SCALE_BLOCK = 4096


@triton.jit
def _dlogits(z, cols, V, t, lse, coef, scale, label_smoothing, softcap, SOFTCAP: tl.constexpr):
    """dloss/dl of logits ``z`` (fp32; capped with SOFTCAP: z = softcap tanh(l / softcap)) at columns
    ``cols`` of a row with target t, times ``scale``."""
    g = tl.exp(z - lse) * coef - label_smoothing / V - tl.where(cols == t, 1.0 - label_smoothing, 0.0)
    if SOFTCAP:
        u = tl.minimum(tl.abs(z) / softcap, 1.0)  # |z| <= softcap; the bound keeps masked (-inf) lanes finite
        g = g * (1.0 - u * u)
    return g * scale


@triton.jit
def _load_logits(ptrs, mask, softcap, SOFTCAP: tl.constexpr):
    """Logits at ``ptrs`` (-inf where not ``mask``): as stored, or with SOFTCAP capped in fp32."""
    z = tl.load(ptrs, mask=mask, other=float("-inf"))
    if SOFTCAP:
        z = tl.where(mask, softcap_math(z.to(tl.float32), softcap), float("-inf"))
    return z


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
    gq_ptr,  # [C, V] out (QUANT_G): dloss/dl quantized per row to fp8 (kernels.fp8), row stride stride_q
    stride_q,
    gs_ptr,  # [C] fp32 out (QUANT_G): the rows' dequantization scales
    V, ignore_index, label_smoothing, z_loss,
    softcap,  # fp32 logit cap c (SOFTCAP): z = c tanh(l / c)
    fp8_max,  # largest finite value of gq's format (QUANT_G)
    HAS_SMOOTHING: tl.constexpr,  # label_smoothing > 0
    SOFTCAP: tl.constexpr,  # cap the logits
    HAS_GRAD: tl.constexpr,
    STORE_Z: tl.constexpr,
    HAS_ROW_GRAD: tl.constexpr,
    QUANT_G: tl.constexpr,  # also write the gradient row quantized to fp8 (the FP8 head's dx GEMM operand)
    SINGLE_PASS: tl.constexpr,  # BLOCK_V >= V: the row is read once and held in registers
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    t = tl.load(target_ptr + row * stride_t)
    valid = t != ignore_index
    offs = tl.arange(0, BLOCK_V)

    # softmax statistics (max, sum of exp(z - max)) and the sum of the logits (label smoothing)
    z_sum = tl.zeros([], tl.float32)
    if SINGLE_PASS:
        # held in the logits' dtype (half the registers of fp32; fp32 once capped), converted where used
        z_row = _load_logits(row_ptr + offs, offs < V, softcap, SOFTCAP)
        m = tl.max(z_row, axis=0).to(tl.float32)
        s = tl.sum(tl.exp(z_row.to(tl.float32) - m), axis=0)
        if HAS_SMOOTHING:
            z_sum = tl.sum(tl.where(offs < V, z_row.to(tl.float32), 0.0), axis=0)
    else:
        m = tl.full([], float("-inf"), tl.float32)  # running max
        s = tl.zeros([], tl.float32)  # running sum of exp(z - m)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            z = _load_logits(row_ptr + cols, cols < V, softcap, SOFTCAP).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            if HAS_SMOOTHING:
                z_sum += tl.sum(tl.where(cols < V, z, 0.0), axis=0)
    lse = m + tl.log(s)
    in_range = valid & (t >= 0) & (t < V)
    z_t = tl.load(row_ptr + tl.where(in_range, t, 0), mask=in_range, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_t = softcap_math(z_t, softcap)
    z_term = z_loss * lse * lse
    loss = lse - (1.0 - label_smoothing) * z_t - label_smoothing / V * z_sum + z_term
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if STORE_Z:
        tl.store(z_ptr + row, tl.where(valid, z_term, 0.0))

    # dloss/dz in place (zeros for ignored rows), scaled by the row's upstream gradient
    if HAS_GRAD:
        scale = tl.where(valid, 1.0, 0.0)
        if HAS_ROW_GRAD:
            scale = scale * tl.load(row_grad_ptr + row * stride_g).to(tl.float32)
        coef = 1.0 + 2.0 * z_loss * lse
        q_row = gq_ptr + row * stride_q
        if SINGLE_PASS:
            g = _dlogits(z_row.to(tl.float32), offs, V, t, lse, coef, scale, label_smoothing, softcap, SOFTCAP)
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=offs < V)
            if QUANT_G:
                inv, g_scale = fp8_scales(tl.max(tl.where(offs < V, tl.abs(g), 0.0), axis=0), fp8_max)
                tl.store(gs_ptr + row, g_scale)
                tl.store(q_row + offs, fp8_saturate(g, inv, fp8_max).to(gq_ptr.dtype.element_ty), mask=offs < V)
        else:
            if QUANT_G:  # the row's largest |gradient| first: one more read of the logits
                amax = tl.zeros([], tl.float32)
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    z = _load_logits(row_ptr + cols, cols < V, softcap, SOFTCAP).to(tl.float32)
                    g = _dlogits(z, cols, V, t, lse, coef, scale, label_smoothing, softcap, SOFTCAP)
                    amax = tl.maximum(amax, tl.max(tl.where(cols < V, tl.abs(g), 0.0), axis=0))
                inv, g_scale = fp8_scales(amax, fp8_max)
                tl.store(gs_ptr + row, g_scale)
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                z = _load_logits(row_ptr + cols, cols < V, softcap, SOFTCAP).to(tl.float32)
                g = _dlogits(z, cols, V, t, lse, coef, scale, label_smoothing, softcap, SOFTCAP)
                tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)
                if QUANT_G:
                    tl.store(q_row + cols, fp8_saturate(g, inv, fp8_max).to(gq_ptr.dtype.element_ty), mask=cols < V)


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
    dst_ptr,  # [n] out: src * dloss * scale (/ prev), in dst's dtype (contiguous; may be src itself)
    n,
    dloss_ptr,  # [1] upstream gradient of the loss
    scale_ptr,  # [1] fp32 reduction scale (1 / #valid rows for mean, else 1)
    prev_ptr,  # [1] fp32 factor an earlier backward already applied to src in place (HAS_PREV)
    factor_ptr,  # [1] fp32 out: dloss * scale, the factor now applied (STORE_FACTOR, program 0)
    HAS_PREV: tl.constexpr,
    STORE_FACTOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    factor = tl.load(dloss_ptr).to(tl.float32) * tl.load(scale_ptr)
    if STORE_FACTOR:
        if pid == 0:
            tl.store(factor_ptr, factor)
    if HAS_PREV:
        factor = factor / tl.load(prev_ptr)
    src = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (src * factor).to(dst_ptr.dtype.element_ty), mask=mask)


def _check_args(x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size, softcap, fp8):
    check_linear_inputs(x, weight)
    if fp8 and (interpreting() or x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < (8, 9)):
        raise ValueError(f"fp8=True needs a CUDA GPU with fp8 tensor cores (compute capability 8.9 or newer); "
                         f"x is on {x.device}{' under the interpreter' if interpreting() else ''}")
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
    if softcap is not None:
        try:
            check_cap(softcap)
        except ValueError as e:
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}") from e


def chunk_for(T: int, V: int, elem: int, budget: int) -> int:
    """Tokens per chunk (``CHUNK_BYTES``): T split into the fewest chunks of one size (T / chunks rounded up
    to a multiple of 64 tokens; the last chunk may be shorter) whose [chunk, V] buffer of ``elem``-byte logits
    fits ``budget`` bytes; at least 64 tokens (whatever the budget), at most T."""
    chunks = max(1, triton.cdiv(T * V * elem, budget))
    while True:
        chunk = min(T, max(64, triton.cdiv(triton.cdiv(T, chunks), 64) * 64))
        if chunk <= 64 or chunk * V * elem <= budget:
            return max(chunk, 1)
        chunks += 1


@functools.lru_cache(maxsize=None)
def default_chunk(T: int, H: int, V: int, elem: int, sms: int) -> tuple[int, int]:
    """(tokens per chunk, splits of the dx GEMM) when no chunk size is given and ``CHUNK_BYTES`` is
    None: the most tokens, in multiples of 64, whose [C, V] logits buffer plus the dx GEMM's fp32
    split partials [splits, C, H] fit Liger-Kernel's logits chunk, next_pow2(T / ceil(V / H)) rows
    of V (the same extra memory), with splits up to :func:`split_k_for`'s choice and filling at
    least MIN_DX_FILL of the GPU (or exactly that choice). At least 64 tokens, at most T."""
    budget = next_pow2(triton.cdiv(T, triton.cdiv(V, H))) * V * elem
    for chunk in range(max(64, budget // (V * elem) // 64 * 64), 63, -64):
        want = split_k_for(chunk, H, V, sms)
        room = (budget - chunk * V * elem) // (chunk * H * 4)
        splits = 1 if want == 1 else min(want, room)
        if splits >= 1 and (splits == want or split_fill(chunk, H, splits, sms) >= MIN_DX_FILL):
            return min(chunk, T), splits
    return min(64, T), split_k_for(64, H, V, sms)


#: launch plans per problem of the row kernel, the gradient scaling and the reduction
_ROW_PLANS, _SCALE_PLANS, _REDUCE_PLANS = Plans(), Plans(), Plans()


def _fp8_empty(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised fp8 [rows, cols] whose row stride is padded to 16 bytes (a TMA operand)."""
    return torch.empty((rows, -(-cols // 16) * 16), dtype=dtype, device=device)[:, :cols]


def _fp8_operands(x2, weight, need_dx, chunk, dev):
    """The FP8 head's quantized operands (kernels.fp8, per-row scales): x and W in e4m3 for the
    logits GEMM, W^T in e4m3 (scales per column of W) for dx = g W, and the chunk's e5m2 gradient
    buffer with its row scales, which the row kernel fills."""
    T, H = x2.shape
    V = weight.shape[0]
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    ops = {"x": _fp8_empty(T, H, e4m3, dev), "sx": torch.empty(T, dtype=torch.float32, device=dev),
           "w": _fp8_empty(V, H, e4m3, dev), "sw": torch.empty(V, dtype=torch.float32, device=dev)}
    if need_dx:
        ops.update(wt=_fp8_empty(H, V, e4m3, dev), swt=torch.empty(H, dtype=torch.float32, device=dev),
                   g=_fp8_empty(min(chunk, T), V, e5m2, dev), sg=torch.empty(min(chunk, T), dtype=torch.float32,
                                                                            device=dev))
    quantize_into(x2, FP8_MAX[e4m3], ops["x"], ops["sx"])
    quantize_into(weight, FP8_MAX[e4m3], ops["w"], ops["sw"], ops.get("wt"), ops.get("swt"))
    return ops


def _chunk_loop(x2, weight, t, ignore_index, label_smoothing, z_loss, chunk, allow_tf32,
                need_dx, need_dw, store_z, row_grad=None, softcap=None, fp8=False):
    """Per-row losses (and z terms) of all T rows; with need_dx / need_dw also dx [T, H] (x's
    dtype) and dW [V, H] (fp32 with DW_FP32, else W's dtype) of sum_i g_i loss_i (g_i = row_grad[i],
    else 1). ``fp8``: the logits and dx GEMMs on fp8 operands (:func:`_fp8_operands`)."""
    T, H = x2.shape
    V = weight.shape[0]
    dev = x2.device
    dx_splits = None  # split_k_for's choice
    if chunk is None and CHUNK_BYTES is None:
        chunk, dx_splits = default_chunk(T, H, V, x2.element_size(), num_sms())
    elif chunk is None:
        chunk = chunk_for(T, V, x2.element_size(), CHUNK_BYTES)
    loss_rows = torch.empty(T, dtype=torch.float32, device=dev)
    z_rows = torch.empty(T, dtype=torch.float32, device=dev) if store_z else None
    dx = torch.empty((T, H), dtype=x2.dtype, device=dev) if need_dx else None
    dw_dtype = torch.float32 if DW_FP32 else weight.dtype
    dw = (torch.zeros if T == 0 else torch.empty)((V, H), dtype=dw_dtype, device=dev) if need_dw else None
    buf = torch.empty((min(chunk, T), V), dtype=x2.dtype, device=dev)
    q = _fp8_operands(x2, weight, need_dx, chunk, dev) if fp8 and T else None
    quant_g = q is not None and need_dx
    single = next_pow2(V) <= (1024 if interpreting() else ROW_SINGLE_PASS_MAX_V)
    block_v = next_pow2(V) if single else min(next_pow2(V), 1024 if interpreting() else ROW_BLOCK_V)
    for i, s in enumerate(range(0, T, chunk)):
        e = min(s + chunk, T)
        if q is None:
            logits = gemm(x2[s:e], weight.t(), buf[: e - s], allow_tf32=allow_tf32)
        else:
            logits = gemm(q["x"][s:e], q["w"].t(), buf[: e - s], a_scale=q["sx"][s:e], b_scale=q["sw"])
        rg_stride = 0 if row_grad is None else row_grad.stride(0)
        flags = dict(HAS_SMOOTHING=label_smoothing > 0, SOFTCAP=softcap is not None, HAS_GRAD=need_dx or need_dw,
                     STORE_Z=store_z, HAS_ROW_GRAD=row_grad is not None, QUANT_G=quant_g, SINGLE_PASS=single)
        gq, sg = (q["g"], q["sg"]) if quant_g else (buf, loss_rows)
        key = (e - s, logits.stride(0), t.stride(0), rg_stride, gq.stride(0), V, ignore_index, block_v, ROW_NUM_WARPS,
               *flags.values())
        plan = _ROW_PLANS.get(key) or _ROW_PLANS.add(key, Launch(
            _linear_cross_entropy_fwd_kernel, (e - s,), **flags, BLOCK_V=block_v,
            num_warps=ROW_NUM_WARPS if not interpreting() else 1))
        plan(logits, logits.stride(0), t[s:e], t.stride(0), loss_rows[s:e],
             loss_rows if z_rows is None else z_rows[s:e],
             loss_rows if row_grad is None else row_grad[s:e], rg_stride, gq, gq.stride(0), sg,
             V, ignore_index, float(label_smoothing), float(z_loss), float(softcap or 1.0),
             FP8_MAX[torch.float8_e5m2])
        if quant_g:
            gemm(gq[: e - s], q["wt"].t(), dx[s:e], split_k=dx_splits, a_scale=sg[: e - s], b_scale=q["swt"])
        elif need_dx:
            gemm(logits, weight, dx[s:e], allow_tf32=allow_tf32, split_k=dx_splits)
        if need_dw:
            gemm(logits.t(), x2[s:e], dw, accumulate=i > 0, allow_tf32=allow_tf32)
    return loss_rows, z_rows, dx, dw


def _scaled(src: torch.Tensor, dtype: torch.dtype, dloss: torch.Tensor, scale: torch.Tensor, in_place: bool,
            prev: torch.Tensor | None = None, factor_out: torch.Tensor | None = None) -> torch.Tensor:
    """src * dloss * scale (/ prev) in ``dtype``: over src itself when ``in_place`` (same dtype),
    else in a new tensor; ``factor_out`` [1] receives dloss * scale."""
    out = src if in_place else torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        key = (n, prev is not None, factor_out is not None, SCALE_BLOCK)
        plan = _SCALE_PLANS.get(key) or _SCALE_PLANS.add(key, Launch(
            _linear_cross_entropy_bwd_kernel, (triton.cdiv(n, SCALE_BLOCK),), HAS_PREV=prev is not None,
            STORE_FACTOR=factor_out is not None, BLOCK=SCALE_BLOCK))
        plan(src, out, n, dloss, scale, scale if prev is None else prev, scale if factor_out is None else factor_out)
    return out


def linear_cross_entropy_fwd(x, weight, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                             reduction="mean", chunk_size=None, need_dx=False, need_dw=False, allow_tf32=True,
                             softcap=None, fp8=False):
    """Loss, z-loss term and, for ``mean``/``sum``, the gradients of the loss (unscaled by dloss).

    Returns ``(loss, z, dx, dw, scale)``: loss and z are 0-dim fp32 (``mean``/``sum``) or per-row
    [...] fp32 (``none``); dx [T, H] in x's dtype and dw [V, H] (fp32 with DW_FP32, else W's
    dtype; None unless requested, and always None for ``none``); scale is the fp32 [1] factor the
    gradients still need (1 / #valid rows for ``mean``, else 1).
    """
    _check_args(x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size, softcap, fp8)
    H = weight.shape[1]
    x2 = as_matrix(x, H)
    t = target.reshape(-1)
    none = reduction == "none"
    loss_rows, z_rows, dx, dw = _chunk_loop(x2, weight, t, ignore_index, label_smoothing, z_loss, chunk_size,
                                            allow_tf32, need_dx and not none, need_dw and not none, store_z=True,
                                            softcap=softcap, fp8=fp8)
    if none:
        return loss_rows.view(target.shape), z_rows.view(target.shape), None, None, None
    loss, z = (torch.empty((), dtype=torch.float32, device=x.device) for _ in range(2))
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    key = (t.numel(), t.stride(0), ignore_index, reduction)
    plan = _REDUCE_PLANS.get(key) or _REDUCE_PLANS.add(key, Launch(
        _linear_cross_entropy_reduce_kernel, (1,), MEAN=reduction == "mean", BLOCK=1024))
    plan(loss_rows, z_rows, t, t.stride(0), loss, z, scale, t.numel(), ignore_index)
    return loss, z, dx, dw, scale


def scale_stored_grads(dloss, dx, dw, scale, weight_dtype, in_place, applied=None):
    """(dx, dW, applied) for the upstream gradient ``dloss`` from the forward's gradients dx, dw
    (either may be None) and reduction ``scale``: each is multiplied by dloss * scale, in place
    when ``in_place`` and its dtype is the output's (dx always; dw unless accumulated in fp32 for a
    lower-precision weight), else into a new tensor. ``applied`` ([1] fp32) is the factor an
    earlier call already applied in place (None: none), divided out here; the returned one is the
    factor for the next call (None unless in place). No PyTorch math: one Triton launch per tensor."""
    dw_in_place = in_place and dw is not None and dw.dtype == weight_dtype
    factor = torch.empty(1, dtype=torch.float32, device=scale.device) if in_place else None
    if dx is not None:
        dx = _scaled(dx, dx.dtype, dloss, scale, in_place, applied if in_place else None, factor)
    if dw is not None:
        dw = _scaled(dw, weight_dtype, dloss, scale, dw_in_place, applied if dw_in_place else None,
                     factor if dx is None else None)
    return dx, dw, factor


def linear_cross_entropy_bwd(dloss, x, weight, target, ignore_index, label_smoothing, z_loss, chunk_size,
                             need_dx, need_dw, allow_tf32, softcap=None, fp8=False):
    """(dx, dW) of ``reduction="none"``: the chunk loop again, each row of dloss/dz times its
    upstream gradient ``dloss[i]``."""
    x2 = as_matrix(x, weight.shape[1])
    _, _, dx, dw = _chunk_loop(x2, weight, target.reshape(-1), ignore_index, label_smoothing, z_loss, chunk_size,
                               allow_tf32, need_dx, need_dw, store_z=False, row_grad=dloss.reshape(-1),
                               softcap=softcap, fp8=fp8)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    return None if dx is None else dx.view(x.shape), dw


def _linear_cross_entropy_setup(ctx, inputs, output):
    """Of the forward op's inputs ``(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
    chunk_size, need_dx, need_dw, allow_tf32, softcap)`` and outputs ``(loss, z, dx, dw, scale)``: saves x,
    weight and target for a ``none`` loss (its backward runs the chunk loop again), else the forward's
    gradients and scale."""
    x, weight, target, *args = inputs
    ctx.none, ctx.x_shape, ctx.weight_dtype = args[3] == "none", x.shape, weight.dtype
    ctx.need_dx, ctx.need_dw = args[5], args[6]
    ctx.args = (*args[:3], *args[4:])  # the options but the reduction, as linear_cross_entropy_bwd_op takes them
    if ctx.none:
        ctx.save_for_backward(x, weight, target)
    else:
        ctx.save_for_backward(*output[2:])


def _linear_cross_entropy_backward(ctx, dloss, _dz, _ddx, _ddw, _dscale, *, bwd, scale):
    """``(dx, dw)`` and None for the other 10 inputs: by ``bwd(dloss, x, weight, target, *options)`` for a
    ``none`` loss, else by ``scale(dloss, dx, dw, scale, weight_dtype)`` of the forward's gradients. Eagerly
    :func:`linear_cross_entropy_bwd` and :func:`scale_stored_grads` (the Function binds fp8 and the
    in-place choice), under torch.compile the backward ops."""
    if ctx.none:
        dx, dw = bwd(dloss, *ctx.saved_tensors, *ctx.args)
    else:
        dx, dw, s = ctx.saved_tensors
        dx, dw = scale(dloss, given(dx, ctx.need_dx), given(dw, ctx.need_dw), s, ctx.weight_dtype)
        if ctx.need_dx:
            dx = dx.view(ctx.x_shape)
    return (given(dx, ctx.need_dx), given(dw, ctx.need_dw)) + (None,) * 10


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The launchers with :func:`_linear_cross_entropy_setup` and :func:`_linear_cross_entropy_backward`, the
    custom op's formula too; ``fp8`` and the in-place scaling of the stored gradients (not op inputs: the op
    has no fp8 head, and may not overwrite its outputs) reach the backward launchers."""

    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size,
                return_z_loss, allow_tf32, softcap, fp8):
        inputs = (x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size,
                  ctx.needs_input_grad[0], ctx.needs_input_grad[1], allow_tf32, softcap)
        out = linear_cross_entropy_fwd(*inputs, fp8)
        _linear_cross_entropy_setup(ctx, inputs, out)
        ctx.fp8, ctx.in_place, ctx.applied = fp8, GRAD_IN_PLACE, None
        loss, z = out[:2]
        if return_z_loss:
            ctx.mark_non_differentiable(z)
            return loss, z
        return loss

    @staticmethod
    def backward(ctx, dloss, *unused):
        def scale(dloss, dx, dw, s, weight_dtype):  # applied: the factor an earlier backward left in place
            dx, dw, ctx.applied = scale_stored_grads(dloss, dx, dw, s, weight_dtype, ctx.in_place, ctx.applied)
            return dx, dw
        bwd = functools.partial(linear_cross_entropy_bwd, fp8=ctx.fp8)
        return _linear_cross_entropy_backward(ctx, dloss, None, None, None, None, bwd=bwd, scale=scale)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd_op(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
                                z_loss: float, reduction: str, chunk_size: Optional[int], need_dx: bool, need_dw: bool,
                                allow_tf32: bool, softcap: Optional[float]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z, dx, dw, scale)`` of :func:`kernels.linear_cross_entropy.linear_cross_entropy_fwd`, absent
    where it gives None (the gradients and the scale for ``reduction="none"``)."""
    out = linear_cross_entropy_fwd(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
                                   chunk_size, need_dx, need_dw, allow_tf32, softcap)
    loss, z, dx, dw, scale = (t if t is not None else absent(x) for t in out)
    return loss, z, dx, dw, scale


@fake(linear_cross_entropy_fwd_op)
def _(x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size, need_dx, need_dw,
      allow_tf32, softcap):
    f32 = dict(dtype=torch.float32)
    if reduction == "none":
        return (x.new_empty(target.shape, **f32), x.new_empty(target.shape, **f32), absent(x), absent(x),
                absent(x))
    dw_dtype = torch.float32 if DW_FP32 else weight.dtype
    return (x.new_empty((), **f32), x.new_empty((), **f32),
            x.new_empty((n_rows(x), x.shape[-1])) if need_dx else absent(x),
            weight.new_empty(weight.shape, dtype=dw_dtype) if need_dw else absent(x), x.new_empty(1, **f32))


@define("tritonllm::linear_cross_entropy_scale", mutates_args=())
def linear_cross_entropy_scale_op(dloss: Tensor, dx: Optional[Tensor], dw: Optional[Tensor], scale: Tensor,
                                  weight_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of a ``mean``/``sum`` loss: the forward's gradients times ``dloss * scale`` into new
    tensors (:func:`kernels.linear_cross_entropy.scale_stored_grads`), absent where not given."""
    dx, dw, _ = scale_stored_grads(dloss, dx, dw, scale, weight_dtype, in_place=False)
    return (dx if dx is not None else absent(scale)), (dw if dw is not None else absent(scale))


@fake(linear_cross_entropy_scale_op)
def _(dloss, dx, dw, scale, weight_dtype):
    return (absent(scale) if dx is None else dx.new_empty(dx.shape),
            absent(scale) if dw is None else dw.new_empty(dw.shape, dtype=weight_dtype))


@define("tritonllm::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd_op(dloss: Tensor, x: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                                label_smoothing: float, z_loss: float, chunk_size: Optional[int], need_dx: bool,
                                need_dw: bool, allow_tf32: bool, softcap: Optional[float]) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of a ``none`` loss: :func:`kernels.linear_cross_entropy.linear_cross_entropy_bwd`."""
    dx, dw = linear_cross_entropy_bwd(dloss, x, weight, target, ignore_index, label_smoothing, z_loss,
                                      chunk_size, need_dx, need_dw, allow_tf32, softcap)
    return (dx if dx is not None else absent(x)), (dw if dw is not None else absent(x))


@fake(linear_cross_entropy_bwd_op)
def _(dloss, x, weight, target, ignore_index, label_smoothing, z_loss, chunk_size, need_dx, need_dw, allow_tf32,
      softcap):
    return x.new_empty(x.shape) if need_dx else absent(x), weight.new_empty(weight.shape) if need_dw else absent(x)


register_formula(linear_cross_entropy_fwd_op, _linear_cross_entropy_setup, _linear_cross_entropy_backward,
                 bwd=linear_cross_entropy_bwd_op, scale=linear_cross_entropy_scale_op)


@compiled("linear_cross_entropy")
def _compiled_linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                                   label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                                   chunk_size: int | None = None, return_z_loss: bool = False, *, allow_tf32: bool = True,
                                   softcap: float | None = None):
    grad = torch.is_grad_enabled()
    loss, z, *_ = linear_cross_entropy_fwd_op(x, weight, target, ignore_index, float(label_smoothing), float(z_loss),
                                              reduction, chunk_size, grad and x.requires_grad,
                                              grad and weight.requires_grad, allow_tf32,
                                              None if softcap is None else float(softcap))
    return (loss, z.detach()) if return_z_loss else loss


@compilable
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                         chunk_size: int | None = None, return_z_loss: bool = False, *, allow_tf32: bool = True,
                         softcap: float | None = None, fp8: bool = False):
    """Cross-entropy of the LM head ``x @ weight.T`` against ``target``, never materializing the logits.

    x [..., H] (fp32/fp16/bf16), weight [V, H] in x's dtype, target [...] (int32/int64, x's leading
    shape). Equals ``cross_entropy(linear(x, weight), target, ignore_index, label_smoothing, z_loss,
    reduction)``, with ``softcap`` (None: off; else c > 0) of ``softcap(linear(x, weight), c)``, the
    logits z = c tanh(l / c) capped in fp32 inside the fused kernel: loss_i = lse - (1 - ls) z_t - ls/V sum_j z_j + z_loss lse^2 per non-ignored row,
    reduced by ``mean`` (over non-ignored rows; 0 when all are ignored), ``sum`` or ``none``
    (per-row fp32 losses, 0 on ignored rows). Tokens go through in chunks of ``chunk_size``
    (default: the fewest equal chunks whose logits fit ``CHUNK_BYTES``, 1 GiB; :func:`chunk_for`): extra
    memory is one [chunk_size, V] buffer (plus the dx GEMM's split partials). For ``mean``/``sum`` the gradients
    are computed in the forward and backward only scales them (in place by default: the returned
    gradients are buffers of the forward). Returns the fp32 loss, or ``(loss, z_loss_term)`` when
    ``return_z_loss`` (the z-loss part of the loss, reduced the same way, for logging; not
    differentiable).

    ``fp8`` (GPU with fp8 tensor cores; off by default): the FP8 head. x's rows and W's rows are
    quantized to e4m3 with per-row scales (:mod:`kernels.fp8`) and the logits GEMM runs on them
    (fp32 accumulation, the scales applied in its epilogue, logits stored in x's dtype); dx = g W
    runs on g quantized per row to e5m2 (by the row kernel, from the fp32 gradient) and W^T
    quantized to e4m3 per column of W; dW = g^T x stays in x's dtype (g and x unquantized: the
    weight gradient sums over every token).
    """
    if not needs_grad(x, weight):
        loss, z, *_ = linear_cross_entropy_fwd(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
                                               chunk_size, allow_tf32=allow_tf32, softcap=softcap, fp8=fp8)
        return (loss, z) if return_z_loss else loss
    return LinearCrossEntropyFunction.apply(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
                                            chunk_size, return_z_loss, allow_tf32, softcap, fp8)
