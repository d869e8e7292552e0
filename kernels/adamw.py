"""Multi-tensor AdamW step and gradient-norm clipping in Triton.

AdamW (decoupled weight decay, Loshchilov & Hutter), step ``s``, as ``torch.optim.AdamW``::

    w <- w * (1 - lr * wd)
    m <- m + (1 - b1) * (g - m)
    v <- b2 * v + (1 - b2) * g^2
    w <- w - lr / (1 - b1^s) * m / (sqrt(v) / sqrt(1 - b2^s) + eps)

in fp32, with ``m``, ``v`` fp32. ``w`` is the parameter, or for a bf16/fp16 parameter with a master
copy the fp32 master, rounded to the parameter's dtype (round to nearest even) and stored into the
parameter by the same kernel.

Everything that changes from step to step can live on the device, so that a CUDA graph can replay
the step: each parameter's step count ``s`` is a 0-d fp32 device tensor (as in
``torch.optim.AdamW(capturable=True)``), read by the kernel and incremented after the update by a
second small kernel; the learning rate is a Python float or a 0-d fp32 device tensor; an optional
int32 flag ``found_inf`` (non-zero: skip) leaves weights, moments and step counts untouched. The
bias corrections ``1 - b^s = 1 - 2^(s log2 b)`` are computed per program in fp64 (``log2 b`` passed
as an fp32 pair hi + lo, so it is exact to fp64 rounding), then rounded to fp32.

Gradient clipping: ``norm = sqrt(sum_i sum g_i^2)`` over every gradient, then every gradient is
scaled in place by ``min(1, max_norm / (norm + eps))`` (as ``torch.nn.utils.clip_grad_norm_``).
The scale stays on the device: no host synchronisation.

Multi-tensor launches: the tensors of one launch are described by a device table of int64
addresses (cast in-kernel with ``.to(tl.pointer_type(...))``), each followed by the tensor's
``numel`` and the index of its first chunk, plus a chunk -> tensor map. Program ``pid`` handles
chunk ``pid``: ``CHUNK`` consecutive elements of one tensor, ``BLOCK`` per loop step (a full step
is unmasked, so that it can use vector loads and stores). A tensor list is split into buckets
of equal dtypes (and 16-byte alignment of every address, which lets loads be vectorized); one
launch per bucket. Tables are cached by the addresses and sizes they encode, so an unchanged
parameter set reuses them and a changed one builds new ones.

Sums of squares are per-chunk partials reduced by one program in a fixed order: deterministic.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import FLOAT_DTYPES, check_flag, check_lr, check_tensor
from .launch import TL_DTYPE, cached, next_pow2, upload
from .custom_op import compilable, compiled, define, eager, fake, present, split_lr, spread

#: elements per program (a chunk: the granularity of the tables), processed BLOCK elements per
#: loop step by NUM_WARPS warps. Large chunks amortise each program's table look-ups (two
#: dependent loads before the first data load). Not measured yet.
CHUNK, BLOCK, NUM_WARPS = 16384, 2048, 8
#: the same under the interpreter, where the cost is per program: large, so a CPU training step
#: takes a few programs (tests/test_adamw.py shrinks them to cover several chunks and steps).
_INTERPRET_CHUNK, _INTERPRET_BLOCK = 65536, 65536
#: partials per step of the single-program norm reduction.
_REDUCE_BLOCK = 4096


@triton.jit
def _chunk(table_ptr, map_ptr, NCOL: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk: (its tensor's table row, first element, number of elements)."""
    pid = tl.program_id(0)
    row = table_ptr + tl.load(map_ptr + pid).to(tl.int64) * NCOL
    start = (pid - tl.load(row + NCOL - 1)) * CHUNK
    return row, start, tl.minimum(tl.load(row + NCOL - 2) - start, CHUNK)


@triton.jit
def _base(row, col: tl.constexpr, start, DTYPE: tl.constexpr):
    """Pointer to element ``start`` of the tensor whose address is in column ``col`` of ``row``."""
    return tl.load(row + col).to(tl.pointer_type(DTYPE)) + start


@triton.jit
def _ptrs(base, offs, ALIGNED: tl.constexpr):
    ptrs = base + offs
    if ALIGNED:  # 16-byte aligned tensor, chunk and step starts: vector loads and stores
        ptrs = tl.multiple_of(ptrs, [16])
    return ptrs


@triton.jit
def _adamw_update(p_base, g_base, m_base, v_base, w_base, offs, mask, decay, beta1c, beta2, beta2c, step_size,
                  bc2_sqrt, eps, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr):
    p_ptrs = _ptrs(p_base, offs, ALIGNED)
    m_ptrs = _ptrs(m_base, offs, ALIGNED)
    v_ptrs = _ptrs(v_base, offs, ALIGNED)
    w_ptrs = _ptrs(w_base, offs, ALIGNED)
    g = tl.load(_ptrs(g_base, offs, ALIGNED), mask=mask).to(tl.float32)
    m = tl.load(m_ptrs, mask=mask)
    v = tl.load(v_ptrs, mask=mask)
    w = tl.load(w_ptrs, mask=mask).to(tl.float32) * decay
    m = m + beta1c * (g - m)
    v = v * beta2 + beta2c * (g * g)
    w = w - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)
    if HAS_MASTER:
        tl.store(w_ptrs, w, mask=mask)
    tl.store(p_ptrs, w.to(P_DTYPE), mask=mask)


@triton.jit
def _adamw_kernel(
    table_ptr,      # int64 [T, 8]: addresses of param, grad, exp_avg, exp_avg_sq, master (or param), step; numel, first chunk
    map_ptr,        # int32 [chunks]: table row of each chunk
    lr_ptr,         # 0-d fp32 learning rate (read when LR_ON_DEVICE)
    skip_ptr,       # 0-d int32: non-zero skips the update (read when HAS_SKIP)
    lr,             # the learning rate when not LR_ON_DEVICE
    weight_decay,
    beta1c,         # 1 - beta1
    beta2,
    beta2c,         # 1 - beta2
    log2_b1_hi, log2_b1_lo,  # log2(beta1) = hi + lo (fp32 pair, fp64 exact)
    log2_b2_hi, log2_b2_lo,  # log2(beta2) = hi + lo
    eps,
    P_DTYPE: tl.constexpr,      # parameter dtype
    G_DTYPE: tl.constexpr,      # gradient dtype
    HAS_MASTER: tl.constexpr,   # column 4 is an fp32 master copy
    LR_ON_DEVICE: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    ALIGNED: tl.constexpr,      # every address is 16-byte aligned
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    skip = tl.load(skip_ptr) != 0 if HAS_SKIP else False
    if not skip:
        row, start, n = _chunk(table_ptr, map_ptr, 8, CHUNK)
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr)
        # this update's step number and the bias corrections, in fp64
        s = tl.load(_base(row, 5, 0, tl.float32)).to(tl.float64) + 1.0
        bc1 = 1.0 - tl.exp2(s * (tl.cast(log2_b1_hi, tl.float64) + tl.cast(log2_b1_lo, tl.float64)))
        bc2 = 1.0 - tl.exp2(s * (tl.cast(log2_b2_hi, tl.float64) + tl.cast(log2_b2_lo, tl.float64)))
        lr64 = tl.cast(lr, tl.float64)
        decay = (1.0 - lr64 * tl.cast(weight_decay, tl.float64)).to(tl.float32)
        step_size = (lr64 / bc1).to(tl.float32)
        bc2_sqrt = tl.sqrt_rn(bc2.to(tl.float32))
        p_base = _base(row, 0, start, P_DTYPE)
        g_base = _base(row, 1, start, G_DTYPE)
        m_base = _base(row, 2, start, tl.float32)
        v_base = _base(row, 3, start, tl.float32)
        w_base = _base(row, 4, start, tl.float32) if HAS_MASTER else p_base
        for off in range(0, n, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            if off + BLOCK <= n:  # full step: no mask, so loads and stores can be vectorized
                _adamw_update(p_base, g_base, m_base, v_base, w_base, offs, None, decay, beta1c, beta2, beta2c,
                              step_size, bc2_sqrt, eps, P_DTYPE, HAS_MASTER, ALIGNED)
            else:
                _adamw_update(p_base, g_base, m_base, v_base, w_base, offs, offs < n, decay, beta1c, beta2, beta2c,
                              step_size, bc2_sqrt, eps, P_DTYPE, HAS_MASTER, ALIGNED)


@triton.jit
def _adamw_count_kernel(
    table_ptr,      # int64 [T, 8] as for _adamw_kernel (column 5: the step count's address)
    skip_ptr,       # 0-d int32: non-zero leaves the counts (read when HAS_SKIP)
    HAS_SKIP: tl.constexpr,
):
    """Step count of the tensor of row ``pid`` += 1 (after its update; one program per tensor)."""
    skip = tl.load(skip_ptr) != 0 if HAS_SKIP else False
    if not skip:
        ptr = tl.load(table_ptr + tl.program_id(0).to(tl.int64) * 8 + 5).to(tl.pointer_type(tl.float32))
        tl.store(ptr, tl.load(ptr) + 1.0)


@triton.jit
def _sq_norm_kernel(
    table_ptr,      # int64 [T, 3]: address of the gradient, numel, first chunk
    map_ptr,        # int32 [chunks]: table row of each chunk
    partial_ptr,    # out: fp32 [chunks], sum of squares of each chunk
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, start, n = _chunk(table_ptr, map_ptr, 3, CHUNK)
    base = _base(row, 0, start, G_DTYPE)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        if off + BLOCK <= n:
            g = tl.load(_ptrs(base, offs, ALIGNED)).to(tl.float32)
        else:
            g = tl.load(_ptrs(base, offs, ALIGNED), mask=offs < n, other=0.0).to(tl.float32)
        acc += g * g
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _sum_partials(partial_ptr, n, BLOCK: tl.constexpr):
    """Sum of ``partial_ptr[0 .. n)`` in fp32, in a fixed order (one program)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < n, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _sum_kernel(
    partial_ptr,    # fp32 [n]: per-chunk sums of squares
    n,
    out_ptr,        # out: 0-d fp32, their sum
    BLOCK: tl.constexpr,
):
    tl.store(out_ptr, _sum_partials(partial_ptr, n, BLOCK))


@triton.jit
def _clip_coef_kernel(
    partial_ptr,    # fp32 [n]: per-chunk sums of squares of every bucket
    n,
    norm_ptr,       # out: 0-d fp32 global L2 norm
    coef_ptr,       # out: 0-d fp32 min(1, max_norm / (norm + eps))
    check_ptr,      # 0-d fp32 value that must be finite too, e.g. the loss (read when HAS_FLAG)
    flag_ptr,       # out: 0-d int32, 1 if the norm or the checked value is not finite, else 0 (when HAS_FLAG)
    max_norm,
    eps,
    HAS_FLAG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    norm = tl.sqrt_rn(_sum_partials(partial_ptr, n, BLOCK))
    tl.store(norm_ptr, norm)
    tl.store(coef_ptr, tl.minimum(tl.div_rn(max_norm, norm + eps), 1.0, propagate_nan=tl.PropagateNan.ALL))
    if HAS_FLAG:
        total = norm + tl.load(check_ptr)  # finite only if both are (inf + -inf and NaN give NaN)
        tl.store(flag_ptr, (total - total != 0.0).to(tl.int32))


@triton.jit
def _scale_kernel(
    table_ptr,      # int64 [T, 3]: address of the gradient, numel, first chunk
    map_ptr,        # int32 [chunks]: table row of each chunk
    coef_ptr,       # 0-d fp32 scale; a scale of exactly 1 leaves the gradients untouched
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    coef = tl.load(coef_ptr)
    if coef != 1.0:
        row, start, n = _chunk(table_ptr, map_ptr, 3, CHUNK)
        base = _base(row, 0, start, G_DTYPE)
        for off in range(0, n, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            ptrs = _ptrs(base, offs, ALIGNED)
            if off + BLOCK <= n:
                tl.store(ptrs, (tl.load(ptrs).to(tl.float32) * coef).to(G_DTYPE))
            else:
                mask = offs < n
                tl.store(ptrs, (tl.load(ptrs, mask=mask).to(tl.float32) * coef).to(G_DTYPE), mask=mask)




def _sizes() -> dict:
    """CHUNK and BLOCK of the multi-tensor kernels (small under the interpreter)."""
    if interpreting():
        return dict(CHUNK=_INTERPRET_CHUNK, BLOCK=_INTERPRET_BLOCK)
    return dict(CHUNK=CHUNK, BLOCK=BLOCK)


def _check_rows(names: tuple[str, ...], dtypes: tuple[tuple, ...], lists: tuple[list, ...], idx: list[int]) -> None:
    """Tensor ``i`` of every list (for ``i`` in ``idx``): allowed dtype, contiguous, on the device of
    ``lists[0][0]`` and with the numel of ``lists[0][i]``. Errors name the list and the index."""
    device = lists[0][0].device
    for i in idx:
        ref = lists[0][i]
        for name, allowed, lst in zip(names, dtypes, lists):
            t = lst[i]
            check_tensor(f"{name}[{i}]", t, dtypes=allowed)
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device} but {names[0]}[0] is on {device}: "
                                 f"one device per call")
            if t.numel() != ref.numel():
                raise ValueError(f"{name}[{i}] has {t.numel()} elements but {names[0]}[{i}] has {ref.numel()}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous")


def _check_scalars(name: str, tensors: list, idx: list[int], device: torch.device) -> None:
    for i in idx:
        t = tensors[i]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
            raise TypeError(f"{name}[{i}] must be a one-element fp32 tensor on {device}, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                            f"{' on ' + str(t.device) if isinstance(t, torch.Tensor) else ''}")


def _launches(names, dtypes, lists, chunk, scalars=None, keep_empty=False):
    """Split the tensors into buckets and give each its device tables.

    ``lists[c][i]`` is column ``c`` of tensor ``i`` (``lists[0]``: the tensors whose numel counts);
    ``scalars``, when given, a list of one 0-d fp32 tensor per row whose address is a last address
    column (the step counts; not part of the alignment). Buckets share the dtypes of every column
    and 16-byte alignment of every address. Yields
    ``(column dtypes, aligned, table, chunk map, chunks)``: row ``i`` of the int64 table holds the
    addresses of tensor ``i``'s columns, its numel and its first chunk. Tables are cached by the
    addresses and sizes they encode (so a cached table is valid for as long as it is kept); the
    inputs are checked when a table is built. A bucket whose tensors are all empty is skipped,
    unless ``keep_empty`` (its step counts still advance; such a bucket yields 0 chunks).
    """
    buckets = {}
    for i, row in enumerate(zip(*lists)):
        addrs = tuple(t.data_ptr() for t in row)
        key = tuple(t.dtype for t in row) + (not any(a % 16 for a in addrs),)
        if scalars is not None:
            addrs += (scalars[i].data_ptr(),)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = ([], [], [])
        bucket[0].append(i)
        bucket[1].append(addrs)
        bucket[2].append(row[0].numel())
    for key, (idx, addrs, numels) in buckets.items():
        device = lists[0][idx[0]].device
        numels = tuple(numels)

        def build_map(numels=numels, device=device):
            counts = torch.tensor([triton.cdiv(n, chunk) for n in numels], dtype=torch.int64)
            first = (torch.cumsum(counts, 0) - counts).tolist()
            chunk_map = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
            return first, upload(chunk_map, device), int(counts.sum())

        def build_table(idx=idx, addrs=addrs, numels=numels, device=device):
            _check_rows(names, dtypes, lists, idx)
            if scalars is not None:
                _check_scalars("steps", scalars, idx, device)
            first, chunk_map, n_chunks = cached(("map", device, chunk, numels), build_map)
            rows = [list(a) + [n, f] for a, n, f in zip(addrs, numels, first)]
            return upload(torch.tensor(rows, dtype=torch.int64), device), chunk_map, n_chunks

        table, chunk_map, n_chunks = cached(("table", device, chunk, numels, tuple(addrs)), build_table)
        if n_chunks or keep_empty:
            yield key[:-1], key[-1], table, chunk_map, n_chunks


def _log2_pair(beta: float) -> tuple[float, float]:
    """``log2(beta)`` as fp32 ``hi + lo`` (``beta`` 0: -inf, so ``beta^s`` is 0)."""
    if beta == 0.0:
        return -math.inf, 0.0
    full = math.log2(beta)
    hi = struct.unpack("f", struct.pack("f", full))[0]
    return hi, full - hi


@compilable
def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, masters=None, *, steps, lr, betas=(0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step, in place, over lists of tensors: one Triton launch per combination of
    parameter dtype, gradient dtype, master copy or not, and 16-byte alignment, plus one tiny
    launch per combination that advances the step counts.

    ``params``: fp32/fp16/bf16 tensors; ``grads``: one per parameter, same numel;
    ``exp_avgs``/``exp_avg_sqs``: fp32, same numel; ``masters``: None, or per parameter None or
    an fp32 master copy that is updated instead of the parameter and then rounded into it.
    ``steps``: per parameter a one-element fp32 tensor on the device, the number of updates done
    so far; this update is number ``steps[i] + 1`` (bias correction) and ``steps[i]`` is then
    incremented. ``lr``: a float or a one-element fp32 device tensor (read by the kernel: a CUDA
    graph replays the current value). ``found_inf``: None or a one-element int32 device tensor;
    non-zero leaves every tensor, the step counts included, untouched. No host synchronisation;
    changing any scalar does not recompile.
    """
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "masters": masters, "steps": steps}
    for name, lst in lists.items():
        if lst is not None and len(lst) != len(params):
            raise ValueError(f"{name} has {len(lst)} tensors but params has {len(params)}")
    if not params:
        return
    device = params[0].device
    lr_on_device = check_lr(lr, device)
    beta1, beta2 = betas
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
    check_flag("found_inf", found_inf, device)
    sizes = _sizes()
    scalars = (0.0 if lr_on_device else float(lr), float(weight_decay), 1.0 - beta1, beta2, 1.0 - beta2,
               *_log2_pair(beta1), *_log2_pair(beta2), float(eps))
    # column 4 is the tensor the update reads and writes in fp32: the master, else the parameter
    weights = params
    if masters is not None:
        for i, (p, w) in enumerate(zip(params, masters)):
            if w is not None and (w.dtype != torch.float32 or p.dtype == torch.float32):
                raise TypeError(f"masters[{i}] must be None or an fp32 copy of a bf16/fp16 parameter, "
                                f"got {w.dtype} for a {p.dtype} parameter")
        weights = [p if w is None else w for p, w in zip(params, masters)]
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters")
    fp32 = (torch.float32,)
    dtypes = (FLOAT_DTYPES, FLOAT_DTYPES, fp32, fp32, FLOAT_DTYPES)
    has_skip = found_inf is not None
    for col_dtypes, aligned, table, chunk_map, n_chunks in _launches(
            names, dtypes, (params, grads, exp_avgs, exp_avg_sqs, weights), sizes["CHUNK"], scalars=steps,
            keep_empty=True):
        p_dtype, g_dtype, w_dtype = col_dtypes[0], col_dtypes[1], col_dtypes[4]
        if n_chunks:  # a bucket of empty tensors (e.g. a rank's empty FSDP shards) only counts its steps
            _adamw_kernel[(n_chunks,)](table, chunk_map, lr if lr_on_device else table,
                                       found_inf if has_skip else table, *scalars, P_DTYPE=TL_DTYPE[p_dtype],
                                       G_DTYPE=TL_DTYPE[g_dtype], HAS_MASTER=w_dtype != p_dtype,
                                       LR_ON_DEVICE=lr_on_device, HAS_SKIP=has_skip, ALIGNED=aligned,
                                       **sizes, num_warps=NUM_WARPS)
        _adamw_count_kernel[(table.shape[0],)](table, found_inf if has_skip else table, HAS_SKIP=has_skip,
                                               num_warps=1)


def _sq_norm_plan(grads: list, device) -> tuple[dict, list, torch.Tensor, int]:
    """The launches over ``grads`` and their per-chunk sums of squares: ``(sizes, launches, partials,
    n_partials)``."""
    sizes = _sizes()
    launches = list(_launches(("grads",), (FLOAT_DTYPES,), (grads,), sizes["CHUNK"]))
    n_partials = sum(launch[-1] for launch in launches)
    partials = torch.empty(max(n_partials, 1), dtype=torch.float32, device=device)
    start = 0
    for (g_dtype,), aligned, table, chunk_map, n_chunks in launches:
        _sq_norm_kernel[(n_chunks,)](table, chunk_map, partials[start:], G_DTYPE=TL_DTYPE[g_dtype],
                                     ALIGNED=aligned, **sizes, num_warps=NUM_WARPS)
        start += n_chunks
    return sizes, launches, partials, n_partials


def _clip_by_partials(sizes, launches, partials, n_partials, max_norm, eps, found_inf, check) -> torch.Tensor:
    """The norm ``sqrt(sum(partials))`` and the scaling of every launch's gradients by
    ``min(1, max_norm / (norm + eps))``; the flag as :func:`clip_grads_` describes."""
    norm = torch.empty((), dtype=torch.float32, device=partials.device)
    coef = torch.empty((), dtype=torch.float32, device=partials.device)
    has_flag = found_inf is not None
    _clip_coef_kernel[(1,)](partials, n_partials, norm, coef, check if has_flag else norm,
                            found_inf if has_flag else norm, float(max_norm), float(eps), HAS_FLAG=has_flag,
                            BLOCK=min(next_pow2(n_partials), _REDUCE_BLOCK), num_warps=4)
    for (g_dtype,), aligned, table, chunk_map, n_chunks in launches:
        _scale_kernel[(n_chunks,)](table, chunk_map, coef, G_DTYPE=TL_DTYPE[g_dtype], ALIGNED=aligned,
                                   **sizes, num_warps=NUM_WARPS)
    return norm


def _check_max_norm(max_norm: float) -> None:
    if not max_norm >= 0.0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")


def _check_clip_args(grads: list, found_inf, check, reduced: bool):
    """The device of ``grads`` (None when empty) after the checks :func:`clip_grads_` documents."""
    if not grads:
        if reduced:
            raise ValueError("grads is empty: with reduce, every holder must pass its (possibly empty) tensors")
        return None
    device = grads[0].device
    check_flag("found_inf", found_inf, device)
    if found_inf is not None and (not isinstance(check, torch.Tensor) or check.dtype != torch.float32
                                  or check.numel() != 1 or check.device != device):
        raise TypeError(f"check must be a one-element fp32 tensor on {device} when found_inf is given")
    return device


@compilable
def clip_grads_(grads, max_norm: float, eps: float = 1e-6, *, found_inf: torch.Tensor | None = None,
                check: torch.Tensor | None = None, reduce=None) -> torch.Tensor:
    """Scale ``grads`` (a list of fp32/fp16/bf16 tensors on one device) in place so that their
    global L2 norm is at most ``max_norm``: ``g *= min(1, max_norm / (norm + eps))``. Returns the
    norm before clipping as a 0-d fp32 tensor; nothing waits for the device.

    ``found_inf`` (a one-element int32 device tensor), when given, is set to 1 if the norm or
    ``check`` (a one-element fp32 device tensor, e.g. the loss; required with ``found_inf``) is not
    finite, else 0: the flag :func:`adamw_step_` reads to skip a bad step on the device.

    ``reduce``: None, or a function called with the 0-d fp32 sum of squares of ``grads`` that
    replaces it in place with the sum over every holder of a part of the gradients (e.g. an
    all-reduce over the ranks that each hold a shard); the norm and the scale then come from
    that total, so every holder clips by the same global norm. The two stages around it are
    :func:`grad_sq_norm` and :func:`clip_grads_by_sq_norm_`."""
    _check_max_norm(max_norm)
    grads = list(grads)
    device = _check_clip_args(grads, found_inf, check, reduce is not None)
    if device is None:
        return torch.zeros((), dtype=torch.float32)
    sizes, launches, partials, n_partials = _sq_norm_plan(grads, device)
    if reduce is not None:
        total = _sum_partials_of(partials, n_partials)
        reduce(total)
        partials, n_partials = total.view(1), 1
    return _clip_by_partials(sizes, launches, partials, n_partials, max_norm, eps, found_inf, check)


def _sum_partials_of(partials: torch.Tensor, n_partials: int) -> torch.Tensor:
    total = torch.empty((), dtype=torch.float32, device=partials.device)
    _sum_kernel[(1,)](partials, n_partials, total, BLOCK=min(next_pow2(n_partials), _REDUCE_BLOCK), num_warps=4)
    return total


def grad_sq_norm(grads) -> torch.Tensor:
    """The 0-d fp32 sum of squares of ``grads`` (non-empty, fp32/fp16/bf16, one device): the first
    stage of :func:`clip_grads_` with ``reduce``, the value handed to the reduce."""
    grads = list(grads)
    device = _check_clip_args(grads, None, None, True)
    _, _, partials, n_partials = _sq_norm_plan(grads, device)
    return _sum_partials_of(partials, n_partials)


def clip_grads_by_sq_norm_(grads, sq_norm: torch.Tensor, max_norm: float, eps: float = 1e-6, *,
                           found_inf: torch.Tensor | None = None, check: torch.Tensor | None = None) -> torch.Tensor:
    """The second stage of :func:`clip_grads_` with ``reduce``: scale ``grads`` in place by
    ``min(1, max_norm / (sqrt(sq_norm) + eps))`` with ``sq_norm`` the 0-d fp32 (reduced) sum of
    squares; returns the norm ``sqrt(sq_norm)``; ``found_inf`` / ``check`` as in :func:`clip_grads_`."""
    _check_max_norm(max_norm)
    grads = list(grads)
    device = _check_clip_args(grads, found_inf, check, True)
    check_tensor("sq_norm", sq_norm, dtypes=(torch.float32,))
    if sq_norm.numel() != 1 or sq_norm.device != device:
        raise ValueError(f"sq_norm must be one fp32 value on {device}, got shape {tuple(sq_norm.shape)} on "
                         f"{sq_norm.device}")
    sizes = _sizes()
    launches = list(_launches(("grads",), (FLOAT_DTYPES,), (grads,), sizes["CHUNK"]))
    return _clip_by_partials(sizes, launches, sq_norm.reshape(1), 1, max_norm, eps, found_inf, check)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::adamw_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "masters", "steps"))
def adamw_step_op(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                  masters: list[Tensor], has_master: list[bool], steps: list[Tensor], lr: float,
                  lr_tensor: Optional[Tensor], beta1: float, beta2: float, eps: float, weight_decay: float,
                  found_inf: Optional[Tensor]) -> None:
    """:func:`kernels.adamw.adamw_step_` (``lr_tensor``, when given, is the learning rate)."""
    eager(adamw_step_)(params, grads, exp_avgs, exp_avg_sqs, spread(masters, has_master), steps=steps,
                       lr=lr if lr_tensor is None else lr_tensor, betas=(beta1, beta2), eps=eps,
                       weight_decay=weight_decay, found_inf=found_inf)


@fake(adamw_step_op)
def _(*args):
    return None


@compiled("adamw_step_")
def _compiled_adamw_step_(params, grads, exp_avgs, exp_avg_sqs, masters=None, *, steps, lr, betas=(0.9, 0.999),
                          eps: float = 1e-8, weight_decay: float = 0.0, found_inf: Tensor | None = None) -> None:
    params = list(params)
    given_masters, has_master = present(masters, len(params))
    adamw_step_op(params, list(grads), list(exp_avgs), list(exp_avg_sqs), given_masters, has_master, list(steps), *split_lr(lr),
                  float(betas[0]), float(betas[1]), float(eps), float(weight_decay), found_inf)


@define("tritonllm::clip_grads", mutates_args=("grads", "found_inf"))
def clip_grads_op(grads: list[Tensor], max_norm: float, eps: float, found_inf: Optional[Tensor],
                  check: Optional[Tensor]) -> Tensor:
    """:func:`kernels.adamw.clip_grads_` without ``reduce``: the norm before clipping."""
    return eager(clip_grads_)(grads, max_norm, eps, found_inf=found_inf, check=check)


@fake(clip_grads_op)
def _(grads, max_norm, eps, found_inf, check):
    return grads[0].new_empty((), dtype=torch.float32)


@define("tritonllm::grad_sq_norm", mutates_args=())
def grad_sq_norm_op(grads: list[Tensor]) -> Tensor:
    """:func:`kernels.adamw.grad_sq_norm`: the 0-d fp32 sum of squares, the first stage of a reduced clip."""
    return grad_sq_norm(grads)


@fake(grad_sq_norm_op)
def _(grads):
    return grads[0].new_empty((), dtype=torch.float32)


@define("tritonllm::clip_grads_by_sq_norm", mutates_args=("grads", "found_inf"))
def clip_grads_by_sq_norm_op(grads: list[Tensor], sq_norm: Tensor, max_norm: float, eps: float,
                             found_inf: Optional[Tensor], check: Optional[Tensor]) -> Tensor:
    """:func:`kernels.adamw.clip_grads_by_sq_norm_`: the second stage, from the reduced sum of squares."""
    return clip_grads_by_sq_norm_(grads, sq_norm, max_norm, eps, found_inf=found_inf, check=check)


@fake(clip_grads_by_sq_norm_op)
def _(grads, sq_norm, max_norm, eps, found_inf, check):
    return sq_norm.new_empty(())


@compiled("clip_grads_")
def _compiled_clip_grads_(grads, max_norm: float, eps: float = 1e-6, *, found_inf: Tensor | None = None,
                          check: Tensor | None = None, reduce=None) -> Tensor:
    """With ``reduce`` (e.g. FSDP2's all-reduce of the sum of squares), three steps the graph keeps: the
    sum-of-squares op, ``reduce`` traced as Python (a collective becomes a functional collective), and the
    scaling op; without, one op."""
    grads = list(grads)
    if reduce is not None:
        if not grads:
            raise ValueError("grads is empty: with reduce, every holder must pass its (possibly empty) tensors")
        total = grad_sq_norm_op(grads)
        reduce(total)
        return clip_grads_by_sq_norm_op(grads, total, float(max_norm), float(eps), found_inf, check)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return clip_grads_op(grads, float(max_norm), float(eps), found_inf, check)
