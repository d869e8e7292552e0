"""Cross-entropy over a vocabulary, with label smoothing and z-loss, in Triton.

For a row of logits ``x`` (length ``V``) with target ``t``, smoothing ``ls`` and z-loss weight ``z``::

    lse    = log sum_j exp(x_j)                       (online softmax: one pass, running max and sum)
    loss   = lse - (1 - ls) * x_t - ls / V * sum_j x_j + z * lse^2
    dloss/dx_j = p_j * (1 + 2 z lse) - (1 - ls) * [j == t] - ls / V,      p_j = exp(x_j - lse)

Rows whose target equals ``ignore_index`` have loss 0 and gradient 0. ``reduction="mean"``
divides by the number of non-ignored rows (0 when every row is ignored), ``"sum"`` adds the
rows, ``"none"`` returns the per-row losses in fp32. All math is fp32 whatever the logits' dtype.

Forward: one program per row streams the row once (chunks of ``BLOCK_V``), writes the row's loss
and ``lse``; a single-program kernel then reduces the rows in a fixed order (deterministic).
Backward: one program per row reads the row again with the saved ``lse`` and writes
``dlogits = dloss * dloss/dx`` (``dloss / n_valid`` for the mean). Traffic for forward + backward:
logits read twice, dlogits written once; saved for backward: ``lse`` (fp32 ``[N]``).
With ``inplace_backward=True`` the backward writes ``dlogits`` over the logits' own storage (as
Liger-Kernel does), so no ``[N, V]`` buffer is allocated; the logits are destroyed.
Offsets are int64, so ``N * V`` may exceed 2^31.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl


from ._interpreter import interpreting
from .checks import INDEX_DTYPES, check_same_device, check_tensor, needs_grad, rows_view
from .launch import Launch, Plans, autotune, next_pow2
from .custom_op import absent, compilable, compiled, define, fake, n_rows, register_formula

REDUCTIONS = ("mean", "sum", "none")

#: forward configurations tried by the autotuner (BLOCK_V, num_warps); not measured yet.
_FWD_CONFIGS = [(4096, 8), (8192, 8), (8192, 16), (16384, 16)]
#: backward configuration: fixed, because the in-place variant cannot be re-run by an autotuner
#: (it overwrites its input); one warp per 512 elements of a chunk, at most _BWD_NUM_WARPS.
#: Not measured yet.
_BWD_BLOCK_V, _BWD_NUM_WARPS = 8192, 16
#: chunk width under the interpreter: small enough that the tests' vocabularies take several chunks.
_INTERPRET_BLOCK_V = 1024
#: rows per step of the single-program reduction.
_REDUCE_BLOCK = 4096


@triton.jit
def _cross_entropy_fwd_kernel(
    x_ptr,          # logits [N, V]: rows at stride_x, columns contiguous
    stride_x,       # elements between consecutive rows of x
    t_ptr,          # targets [N], int32 or int64, contiguous
    loss_ptr,       # out: per-row loss [N] fp32
    lse_ptr,        # out: per-row logsumexp [N] fp32 (0 for ignored rows)
    z_ptr,          # out: per-row z-loss term z * lse^2 [N] fp32 (written when STORE_Z)
    err_ptr,        # out: 0-d int32 set to 1 when a target is outside [0, V) and not ignore_index
    V,              # vocabulary size
    ignore_index,   # target value of rows to skip
    label_smoothing,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    STORE_Z: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row).to(tl.int64)
    if (t == ignore_index) | (t < 0) | (t >= V):
        if t != ignore_index:
            tl.store(err_ptr, 1)
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if STORE_Z:
            tl.store(z_ptr + row, 0.0)
        return
    x_row = x_ptr + row * stride_x
    x_t = tl.load(x_row + t).to(tl.float32)      # issued before the loop: its latency overlaps the stream
    m = tl.full([], float("-inf"), tl.float32)   # running max
    s = tl.zeros([], tl.float32)                 # running sum of exp(x - m)
    sx = tl.zeros([], tl.float32)                # running sum of x (label smoothing)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            sx += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(s)
    loss = lse - (1.0 - label_smoothing) * x_t
    if HAS_SMOOTHING:
        loss -= label_smoothing / V * sx
    z_term = z_loss * lse * lse
    if HAS_Z:
        loss += z_term
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    if STORE_Z:
        tl.store(z_ptr + row, z_term)


_cross_entropy_fwd_tuned = autotune(
    configs=[triton.Config({"BLOCK_V": b}, num_warps=w) for b, w in _FWD_CONFIGS],
    key=["V"],
)(_cross_entropy_fwd_kernel)
#: launch plans per problem: interpreter forward, reduction, backward (the GPU forward's are in
#: _cross_entropy_fwd_tuned.plans)
_FWD_PLANS, _REDUCE_PLANS, _BWD_PLANS = Plans(), Plans(), Plans()


@functools.lru_cache(maxsize=None)
def _err_sink(device: torch.device) -> torch.Tensor:
    """The out-of-range flag the forward kernel writes when nobody reads it (``validate=False``):
    one buffer per device, allocated once."""
    return torch.zeros((), dtype=torch.int32, device=device)


@triton.jit
def _cross_entropy_reduce_kernel(
    loss_ptr,       # per-row losses [N] fp32
    z_ptr,          # per-row z-loss terms [N] fp32 (read when HAS_Z_OUT)
    t_ptr,          # targets [N], int32 or int64
    out_ptr,        # out: reduced loss, 0-d fp32
    z_out_ptr,      # out: reduced z-loss, 0-d fp32 (written when HAS_Z_OUT)
    count_ptr,      # out: number of non-ignored rows, 0-d fp32
    N,
    ignore_index,
    MEAN: tl.constexpr,
    HAS_Z_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    acc = tl.zeros([BLOCK], tl.float32)
    z_acc = tl.zeros([BLOCK], tl.float32)
    cnt = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        t = tl.load(t_ptr + offs, mask=mask, other=ignore_index)
        cnt += (t != ignore_index).to(tl.int32)
        acc += tl.load(loss_ptr + offs, mask=mask, other=0.0)
        if HAS_Z_OUT:
            z_acc += tl.load(z_ptr + offs, mask=mask, other=0.0)
    count = tl.sum(cnt, axis=0).to(tl.float32)
    div = tl.maximum(count, 1.0) if MEAN else 1.0
    tl.store(out_ptr, tl.sum(acc, axis=0) / div)
    if HAS_Z_OUT:
        tl.store(z_out_ptr, tl.sum(z_acc, axis=0) / div)
    tl.store(count_ptr, count)


@triton.jit
def _cross_entropy_bwd_kernel(
    x_ptr,          # logits [N, V]: rows at stride_x, columns contiguous
    stride_x,
    dx_ptr,         # out: dlogits [N, V] (may be x_ptr itself), rows at stride_dx
    stride_dx,
    t_ptr,          # targets [N], int32 or int64
    lse_ptr,        # per-row logsumexp [N] fp32 from the forward
    dloss_ptr,      # upstream gradient: [N] fp32 (reduction "none") or 0-d (stride 0)
    stride_dloss,   # 1 for "none", 0 for "mean"/"sum"
    count_ptr,      # number of non-ignored rows, 0-d fp32 (read when MEAN)
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    MEAN: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row).to(tl.int64)
    dx_row = dx_ptr + row * stride_dx
    if t == ignore_index:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(dx_row + cols, tl.zeros([BLOCK_V], tl.float32).to(dx_ptr.dtype.element_ty), mask=cols < V)
        return
    x_row = x_ptr + row * stride_x
    lse = tl.load(lse_ptr + row)
    dl = tl.load(dloss_ptr + row * stride_dloss).to(tl.float32)
    if MEAN:
        dl = dl / tl.maximum(tl.load(count_ptr), 1.0)
    coef = dl * (1.0 + 2.0 * z_loss * lse) if HAS_Z else dl
    hit = (1.0 - label_smoothing) * dl
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * coef - tl.where(cols == t, hit, 0.0)
        if HAS_SMOOTHING:
            g -= label_smoothing / V * dl
        tl.store(dx_row + cols, g.to(dx_ptr.dtype.element_ty), mask=mask)


def _check_args(logits, target, ignore_index, label_smoothing, z_loss, reduction):
    check_tensor("logits", logits, min_ndim=2)
    check_tensor("target", target, dtypes=INDEX_DTYPES)
    check_same_device(logits=logits, target=target)
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(logits.shape[:-1])} (logits' leading dimensions), "
                         f"got {tuple(target.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")


def cross_entropy_fwd(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
                      return_z_loss=False, validate=True):
    """Forward launcher. Returns ``(loss, z, lse, count, x2d, t1d)``: the loss (0-d fp32, or fp32 of
    ``target``'s shape for ``"none"``), the z-loss term reduced the same way (None unless
    ``return_z_loss``), the per-row logsumexp and the non-ignored row count (0-d, None unless
    ``"mean"``) that the backward needs, and the 2-D logits / 1-D targets the kernels read.
    ``validate``: see :func:`cross_entropy`."""
    _check_args(logits, target, ignore_index, label_smoothing, z_loss, reduction)
    V = logits.shape[-1]
    x = rows_view(logits, V)
    t = target.reshape(-1).contiguous()
    N = x.shape[0]
    dev = logits.device
    rows = torch.empty(N, dtype=torch.float32, device=dev)
    lse = torch.empty(N, dtype=torch.float32, device=dev)
    z_rows = torch.empty(N, dtype=torch.float32, device=dev) if return_z_loss else rows
    err = torch.zeros((), dtype=torch.int32, device=dev) if validate else _err_sink(dev)
    args = (x, x.stride(0), t, rows, lse, z_rows, err, V, ignore_index, float(label_smoothing), float(z_loss))
    flags = dict(HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss > 0, STORE_Z=return_z_loss)
    if N > 0:
        key = (N, V, x.stride(0), ignore_index, *flags.values())
        if interpreting():
            plan = _FWD_PLANS.get(key) or _FWD_PLANS.add(key, Launch(
                _cross_entropy_fwd_kernel, (N,), **flags, BLOCK_V=min(next_pow2(V), _INTERPRET_BLOCK_V)))
            plan(*args)
        else:
            _cross_entropy_fwd_tuned.launch(key, (N,), *args, **flags)
    if validate and err.item():  # the one host synchronisation of the op
        raise ValueError(f"target has values outside [0, {V}) that are not ignore_index={ignore_index}")
    if reduction == "none":
        z = z_rows.view(target.shape) if return_z_loss else None
        return rows.view(target.shape), z, lse, None, x, t
    loss = torch.empty((), dtype=torch.float32, device=dev)
    z = torch.empty((), dtype=torch.float32, device=dev)
    count = torch.empty((), dtype=torch.float32, device=dev)
    key = (N, ignore_index, reduction, return_z_loss)
    plan = _REDUCE_PLANS.get(key) or _REDUCE_PLANS.add(key, Launch(
        _cross_entropy_reduce_kernel, (1,), MEAN=reduction == "mean", HAS_Z_OUT=return_z_loss,
        BLOCK=min(next_pow2(N), _REDUCE_BLOCK), num_warps=4))
    plan(rows, z_rows, t, loss, z, count, N, ignore_index)
    return loss, (z if return_z_loss else None), lse, (count if reduction == "mean" else None), x, t


def cross_entropy_bwd(dloss, x, t, lse, count, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                      inplace=False):
    """Backward launcher: ``dlogits [N, V]`` in the logits' dtype from the upstream gradient
    ``dloss`` (0-d for "mean"/"sum", per row for "none"), the 2-D logits ``x``, flat targets ``t``,
    the saved ``lse`` and, for the mean, the non-ignored row ``count``. With ``inplace`` the result
    is written over ``x``."""
    N, V = x.shape
    dx = x if inplace else torch.empty((N, V), dtype=x.dtype, device=x.device)
    if N == 0:
        return dx
    dl = dloss.reshape(-1) if dloss.dim() else dloss
    stride_dl = dl.stride(0) if dl.dim() else 0
    flags = dict(MEAN=count is not None, HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss > 0)
    key = (N, V, x.stride(0), dx.stride(0), stride_dl, ignore_index, *flags.values())
    plan = _BWD_PLANS.get(key)
    if plan is None:
        block = min(next_pow2(V), _INTERPRET_BLOCK_V if interpreting() else _BWD_BLOCK_V)
        plan = _BWD_PLANS.add(key, Launch(_cross_entropy_bwd_kernel, (N,), **flags, BLOCK_V=block,
                                          num_warps=max(1, min(_BWD_NUM_WARPS, block // 512))))
    plan(x, x.stride(0), dx, dx.stride(0), t, lse, dl, stride_dl, count if count is not None else lse,
         V, ignore_index, float(label_smoothing), float(z_loss))
    return dx


def cross_entropy_logits_bwd(dloss, logits, target, lse, count, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                             inplace=False):
    """:func:`cross_entropy_bwd` on the logits ``[..., V]`` and targets ``[...]`` the forward was given:
    dlogits in the logits' shape (with ``inplace``, written over the logits' row view)."""
    V = logits.shape[-1]
    dx = cross_entropy_bwd(dloss, rows_view(logits, V), target.reshape(-1).contiguous(), lse, count,
                           ignore_index, label_smoothing, z_loss, inplace)
    return dx.view(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    """Of the forward op's inputs and ``(loss, z, lse, count)``: saves the logits, targets, ``lse`` and (for
    the mean) ``count``, the scalars the backward needs in ``ctx.args``."""
    logits, target, ignore_index, label_smoothing, z_loss, reduction, _, _ = inputs
    ctx.args, ctx.mean = (ignore_index, label_smoothing, z_loss), reduction == "mean"
    ctx.save_for_backward(logits, target, output[2], output[3])


def _cross_entropy_backward(ctx, dloss, _dz, _dlse, _dcount, *, bwd=cross_entropy_logits_bwd):
    """The logits' gradient (and None for the other 7 inputs) by ``bwd``: :func:`cross_entropy_logits_bwd`
    eagerly (the Function binds its ``inplace``), the backward op under torch.compile."""
    logits, target, lse, count = ctx.saved_tensors
    dx = bwd(dloss, logits, target, lse, count if ctx.mean else None, *ctx.args)
    return dx, None, None, None, None, None, None, None


class CrossEntropyFunction(torch.autograd.Function):
    """The launchers with :func:`_cross_entropy_setup` and :func:`_cross_entropy_backward`, the custom op's
    formula too; ``inplace_backward`` (not an op input: an op may not overwrite its input) reaches the
    backward launcher."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, z_loss, reduction, return_z_loss,
                inplace_backward, validate):
        inputs = (logits, target, ignore_index, label_smoothing, z_loss, reduction, return_z_loss, validate)
        loss, z, lse, count, _, _ = cross_entropy_fwd(*inputs)
        _cross_entropy_setup(ctx, inputs, (loss, z, lse, count))
        ctx.inplace = inplace_backward
        if return_z_loss:
            ctx.mark_non_differentiable(z)
            return loss, z
        return loss

    @staticmethod
    def backward(ctx, dloss, *_):
        bwd = functools.partial(cross_entropy_logits_bwd, inplace=ctx.inplace)
        return *_cross_entropy_backward(ctx, dloss, None, None, None, bwd=bwd), None  # None for inplace_backward


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd_op(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
                         reduction: str, return_z_loss: bool, validate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z or absent, lse, count or absent)`` of :func:`kernels.cross_entropy.cross_entropy_fwd`."""
    loss, z, lse, count, _, _ = cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss,
                                                  reduction, return_z_loss, validate)
    return loss, (z if z is not None else absent(lse)), lse, (count if count is not None else absent(lse))


@fake(cross_entropy_fwd_op)
def _(logits, target, ignore_index, label_smoothing, z_loss, reduction, return_z_loss, validate):
    f32 = dict(dtype=torch.float32)
    shape = target.shape if reduction == "none" else ()
    return (logits.new_empty(shape, **f32), logits.new_empty(shape if return_z_loss else 0, **f32),
            logits.new_empty(n_rows(logits), **f32), logits.new_empty(() if reduction == "mean" else 0, **f32))


@define("tritonllm::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd_op(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Optional[Tensor],
                         ignore_index: int, label_smoothing: float, z_loss: float) -> Tensor:
    """dlogits (logits' shape): :func:`kernels.cross_entropy.cross_entropy_logits_bwd`."""
    return cross_entropy_logits_bwd(dloss, logits, target, lse, count, ignore_index, label_smoothing, z_loss)


@fake(cross_entropy_bwd_op)
def _(dloss, logits, target, lse, count, ignore_index, label_smoothing, z_loss):
    return logits.new_empty(logits.shape)


register_formula(cross_entropy_fwd_op, _cross_entropy_setup, _cross_entropy_backward, bwd=cross_entropy_bwd_op)


@compiled("cross_entropy")
def _compiled_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                            z_loss: float = 0.0, reduction: str = "mean", return_z_loss: bool = False,
                            inplace_backward: bool = False, validate: bool = True):
    loss, z, _, _ = cross_entropy_fwd_op(logits, target, ignore_index, float(label_smoothing), float(z_loss), reduction,
                                         return_z_loss, validate)
    return (loss, z.detach()) if return_z_loss else loss


@compilable
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                  return_z_loss: bool = False, inplace_backward: bool = False, validate: bool = True):
    """Cross-entropy of ``logits`` ``[..., V]`` (fp32/fp16/bf16) against ``target`` ``[...]`` (int32/int64).

    ``loss_i = lse_i - (1 - ls) * x_{i,t_i} - ls / V * sum_j x_ij + z_loss * lse_i^2`` computed in
    fp32, with ``lse_i = log sum_j exp(x_ij)``; rows with ``target == ignore_index`` contribute 0
    loss and 0 gradient. ``reduction``: ``"mean"`` (over non-ignored rows; 0 if there are none),
    ``"sum"`` (0-d fp32) or ``"none"`` (fp32 of ``target``'s shape).

    ``return_z_loss=True`` returns ``(loss, z)`` where ``z`` is the z-loss part of the loss
    (``z_loss * lse^2``), reduced the same way and detached, for logging.
    ``inplace_backward=True`` lets the backward write the gradient over ``logits``' storage, saving
    one ``[N, V]`` buffer; ``logits`` must not be used after the backward. Targets outside
    ``[0, V)`` that are not ``ignore_index`` raise a ValueError: the forward kernel flags them and
    the host reads the flag (one synchronisation per call). ``validate=False`` skips that read (no
    synchronisation, so the call can be captured in a CUDA graph, as F.cross_entropy checks on the
    device): such targets then go undetected and their rows add 0 to the loss.
    """
    if needs_grad(logits):
        return CrossEntropyFunction.apply(logits, target, ignore_index, label_smoothing, z_loss, reduction,
                                          return_z_loss, inplace_backward, validate)
    loss, z = cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss, reduction, return_z_loss,
                                validate)[:2]  # nothing to differentiate: no autograd node
    return (loss, z) if return_z_loss else loss
