"""Mixture-of-Experts token permutation: sort assignments by expert, gather, combine.

``T`` tokens each routed to ``k`` experts give ``N = T k`` assignments ``a = t k + j`` with expert
``idx[a]``. Dropless: every assignment gets a row, no capacity factor.

Sort (integers, no gradient), a histogram + prefix sum + stable scatter over blocks of assignments::

    counts[e]           = #{a : idx[a] = e}
    offsets[e]          = sum_{e' < e} counts[e']                 expert_offsets, [E + 1], offsets[E] = N
    positions[a]        = offsets[idx[a]] + #{a' < a : idx[a'] = idx[a]}   (token order kept within an expert)
    slots[positions[a]] = a

Gather (dispatch) and combine, each with its backward::

    gather:   xs[p] = x[slots[p] // k]                  dx[t] = sum_j dxs[positions[t, j]]
    combine:  y[t]  = sum_j w[t, j] o[positions[t, j]]  do[p] = w[a] dy[a // k]  (a = slots[p])
                                                        dw[t, j] = <dy[t], o[positions[t, j]]>

Every output row is written by exactly one program, which sums a token's k contributions in slot
order in fp32: no atomics, deterministic. No host synchronisation: ``N`` is known from the shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import INDEX_DTYPES, check_same_device, check_tensor, rows_view
from .launch import next_pow2
from .custom_op import absent, compilable, compiled, define, eager, fake, given, register_formula


@triton.jit
def _block_onehot(idx_ptr, pid, N, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Assignments a of block ``pid``, their experts and the [BLOCK, BLOCK_E] int32 one-hot."""
    a = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(idx_ptr + a, mask=a < N, other=-1).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, -1)
    onehot = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return a, ids, onehot


@triton.jit
def _moe_hist_kernel(
    idx_ptr,      # [N] expert of each assignment (int32 or int64), contiguous
    bcount_ptr,   # [G, E] int32 out: assignments per expert in each block of BLOCK assignments
    N, E,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    _, _, onehot = _block_onehot(idx_ptr, pid, N, E, BLOCK, BLOCK_E)
    cols = tl.arange(0, BLOCK_E)
    tl.store(bcount_ptr + pid.to(tl.int64) * E + cols, tl.sum(onehot, axis=0), mask=cols < E)


@triton.jit
def _moe_scan_kernel(
    bcount_ptr,   # [G, E] int32 in: block counts; out: first sorted position of each block's run
    offsets_ptr,  # [E + 1] int32 out: expert_offsets
    G, E, N,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        m = (g < G)[:, None] & cmask[None, :]
        totals += tl.sum(tl.load(bcount_ptr + g.to(tl.int64)[:, None] * E + cols[None, :], mask=m, other=0), axis=0)
    run = tl.cumsum(totals, axis=0) - totals
    tl.store(offsets_ptr + cols, run, mask=cmask)
    tl.store(offsets_ptr + E, N)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        m = (g < G)[:, None] & cmask[None, :]
        ptrs = bcount_ptr + g.to(tl.int64)[:, None] * E + cols[None, :]
        c = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + run[None, :], mask=m)
        run += tl.sum(c, axis=0)


@triton.jit
def _moe_scatter_kernel(
    idx_ptr,      # [N] expert of each assignment, contiguous
    bstart_ptr,   # [G, E] int32 first sorted position of each block's run (from _moe_scan_kernel)
    pos_ptr,      # [N] int32 out: sorted position of each assignment
    slots_ptr,    # [N] int32 out: assignment of each sorted position
    N, E,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    a, ids, onehot = _block_onehot(idx_ptr, pid, N, E, BLOCK, BLOCK_E)
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - onehot), axis=1)
    valid = ids >= 0
    base = tl.load(bstart_ptr + pid.to(tl.int64) * E + ids, mask=valid, other=0)
    pos = base + rank
    tl.store(pos_ptr + a, pos, mask=valid)
    tl.store(slots_ptr + pos.to(tl.int64), a.to(tl.int32), mask=valid)


@triton.jit
def _moe_gather_kernel(
    src_ptr,      # [T, H] rows indexed by token, last dim contiguous
    stride_src,   # row stride of src
    slots_ptr,    # [N] int32 assignment a = t k + j of each sorted row
    scale_ptr,    # [N] per-assignment factor (flat [T, k] weights; HAS_SCALE)
    out_ptr,      # [N, H] out: sorted rows, contiguous
    other_ptr,    # [N, H] sorted rows to take the dot product with (DOT), last dim contiguous
    stride_other, # row stride of other
    dot_ptr,      # [N] out: <src[a // k], other[p]> per assignment (flat [T, k]; DOT)
    N, H, K,
    HAS_SCALE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    pmask = p < N
    a = tl.load(slots_ptr + p, mask=pmask, other=0).to(tl.int64)
    src_rows = src_ptr + (a // K) * stride_src
    if HAS_SCALE:
        w = tl.load(scale_ptr + a, mask=pmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        m = pmask[:, None] & (hs < H)[None, :]
        v = tl.load(src_rows[:, None] + hs[None, :], mask=m, other=0.0).to(tl.float32)
        if DOT:
            o = tl.load(other_ptr + p[:, None] * stride_other + hs[None, :], mask=m, other=0.0)
            acc += tl.sum(v * o.to(tl.float32), axis=1)
        if HAS_SCALE:
            v = v * w[:, None]
        tl.store(out_ptr + p[:, None] * H + hs[None, :], v.to(out_ptr.dtype.element_ty), mask=m)
    if DOT:
        tl.store(dot_ptr + a, acc.to(dot_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _moe_combine_kernel(
    src_ptr,      # [N, H] sorted rows, last dim contiguous
    stride_src,   # row stride of src
    pos_ptr,      # [T, K] int32 sorted position of each assignment, contiguous
    w_ptr,        # [T, K] weight of each assignment, contiguous (HAS_W)
    out_ptr,      # [T, H] out, contiguous
    T, H,
    K: tl.constexpr, HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    tmask = t < T
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        m = tmask[:, None] & (hs < H)[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            pos = tl.load(pos_ptr + t * K + j, mask=tmask, other=0).to(tl.int64)
            v = tl.load(src_ptr + pos[:, None] * stride_src + hs[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t * K + j, mask=tmask, other=0.0).to(tl.float32)[:, None]
            acc += v
        tl.store(out_ptr + t[:, None] * H + hs[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


class MoEPlan(NamedTuple):
    """Where each (token, slot) assignment goes when rows are grouped by expert (:func:`moe_sort`)."""

    expert_offsets: torch.Tensor  #: [E + 1] int32: rows of expert e are offsets[e]:offsets[e + 1]
    positions: torch.Tensor       #: [T, k] int32 sorted row of each assignment
    slots: torch.Tensor           #: [T k] int32 assignment t k + j of each sorted row


def _sort_block(n: int, block_e: int) -> int:
    """Assignments per program of the histogram/scatter: a [BLOCK, BLOCK_E] one-hot of 16K
    elements on the GPU; 128 under the interpreter (few programs, still several blocks in tests)."""
    if interpreting():
        return min(next_pow2(n), 128)
    return max(16, min(next_pow2(n), 16384 // block_e))


def _row_blocks(rows: int, h: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H) of the row kernels: 4K elements per program on the GPU, one program
    for up to 16K elements under the interpreter."""
    block_h = min(next_pow2(h), 4096)
    budget = 16384 if interpreting() else 4096
    return min(next_pow2(rows), max(1, budget // block_h)), block_h


@compilable
def moe_sort(indices: torch.Tensor, num_experts: int) -> MoEPlan:
    """Group the assignments ``indices`` (``[T, k]``, experts in ``[0, num_experts)``) by expert.

    Returns a :class:`MoEPlan`; stable (within an expert, rows keep token order), deterministic,
    without host synchronisation. Indices outside ``[0, num_experts)`` are not checked on the
    device (that would need a synchronisation); their assignments get no row.
    """
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, ndim=2)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    T, k = indices.shape
    N, E = T * k, num_experts
    if N == 0:
        raise ValueError(f"indices must hold at least one assignment, got shape {tuple(indices.shape)}")
    dev = indices.device
    flat = indices.contiguous().view(-1)
    block_e = next_pow2(E)
    block = _sort_block(N, block_e)
    G = triton.cdiv(N, block)
    bcount = torch.empty((G, E), dtype=torch.int32, device=dev)
    offsets = torch.empty((E + 1,), dtype=torch.int32, device=dev)
    positions = torch.empty((T, k), dtype=torch.int32, device=dev)
    slots = torch.empty((N,), dtype=torch.int32, device=dev)
    _moe_hist_kernel[(G,)](flat, bcount, N, E, BLOCK=block, BLOCK_E=block_e, num_warps=4)
    _moe_scan_kernel[(1,)](bcount, offsets, G, E, N, BLOCK_G=max(1, min(next_pow2(G), 4096 // block_e)),
                           BLOCK_E=block_e, num_warps=4)
    _moe_scatter_kernel[(G,)](flat, bcount, positions, slots, N, E, BLOCK=block, BLOCK_E=block_e, num_warps=4)
    return MoEPlan(offsets, positions, slots)


def _gather(src, slots, k, scale=None, other=None):
    """out[p] = scale[a] * src[a // k] with a = slots[p]; with ``other`` also dot[a] = <src[a // k], other[p]>."""
    N, H = slots.shape[0], src.shape[1]
    out = torch.empty((N, H), dtype=src.dtype, device=src.device)
    dot = torch.empty((N,), dtype=scale.dtype, device=src.device) if other is not None else None
    block_r, block_h = _row_blocks(N, H)
    _moe_gather_kernel[(triton.cdiv(N, block_r),)](
        src, src.stride(0), slots, scale if scale is not None else src, out,
        other if other is not None else src, other.stride(0) if other is not None else 0,
        dot if dot is not None else src, N, H, k,
        HAS_SCALE=scale is not None, DOT=other is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
    )
    return out, dot


def _combine(src, positions, weights=None):
    """out[t] = sum_j weights[t, j] * src[positions[t, j]] (weights 1 when None)."""
    T, k = positions.shape
    H = src.shape[1]
    out = torch.empty((T, H), dtype=src.dtype, device=src.device)
    block_r, block_h = _row_blocks(T, H)
    _moe_combine_kernel[(triton.cdiv(T, block_r),)](
        src, src.stride(0), positions, weights if weights is not None else src, out, T, H,
        K=k, HAS_W=weights is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
    )
    return out


def check_plan(plan):
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"plan must be the MoEPlan returned by moe_sort, got {type(plan).__name__}")
    check_tensor("plan.positions", plan.positions, dtypes=(torch.int32,), ndim=2)
    check_tensor("plan.slots", plan.slots, dtypes=(torch.int32,), ndim=1)


def moe_gather_fwd(x: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """Rows of ``x`` ([T, H]) in expert order: ``[T k, H]``."""
    check_tensor("x", x, ndim=2)
    check_plan(plan)
    check_same_device(x=x, positions=plan.positions)
    if x.shape[0] != plan.positions.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but the plan routes {plan.positions.shape[0]} tokens")
    x = rows_view(x, x.shape[1])
    return _gather(x, plan.slots, plan.positions.shape[1])[0]


def moe_gather_bwd(d_sorted: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """dx[t] = sum_j d_sorted[positions[t, j]]."""
    return _combine(rows_view(d_sorted, d_sorted.shape[1]), positions)


def moe_combine_fwd(expert_out: torch.Tensor, weights: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * expert_out[positions[t, j]]: ``[T, H]`` in expert_out's dtype."""
    check_tensor("expert_out", expert_out, ndim=2)
    check_tensor("weights", weights, ndim=2)
    check_plan(plan)
    check_same_device(expert_out=expert_out, weights=weights, positions=plan.positions)
    if expert_out.shape[0] != plan.slots.shape[0]:
        raise ValueError(f"expert_out has {expert_out.shape[0]} rows, expected {plan.slots.shape[0]} (T k)")
    if weights.shape != plan.positions.shape:
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected {tuple(plan.positions.shape)} [T, k]")
    return _combine(rows_view(expert_out, expert_out.shape[1]), plan.positions, weights.contiguous())


def moe_combine_bwd(dy, expert_out, weights, slots, need_dw: bool):
    """(d_expert_out [T k, H], d_weights [T, k] or None) of the combine."""
    dy = rows_view(dy, dy.shape[1])
    T, k = weights.shape
    other = rows_view(expert_out, expert_out.shape[1]) if need_dw else None
    d_out, dw = _gather(dy, slots, k, scale=weights, other=other)
    return d_out, dw.view(T, k) if dw is not None else None


def _moe_gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _moe_gather_backward(ctx, d_sorted, *, bwd=moe_gather_bwd):
    """``(dx, None, None, None)`` by ``bwd``: the launcher eagerly, the backward op under torch.compile."""
    return bwd(d_sorted, ctx.saved_tensors[0]), None, None, None


class MoEGatherFunction(torch.autograd.Function):
    """The launchers with :func:`_moe_gather_setup` and :func:`_moe_gather_backward`, the custom op's
    formula too."""

    @staticmethod
    def forward(ctx, x, expert_offsets, positions, slots):
        out = moe_gather_fwd(x, MoEPlan(expert_offsets, positions, slots))
        _moe_gather_setup(ctx, (x, expert_offsets, positions, slots), out)
        return out

    @staticmethod
    def backward(ctx, d_sorted):
        return _moe_gather_backward(ctx, d_sorted)


def _moe_combine_setup(ctx, inputs, output):
    expert_out, weights, _, _, slots = inputs
    ctx.save_for_backward(expert_out, weights, slots)


def _moe_combine_backward(ctx, dy, *, bwd=moe_combine_bwd):
    """``(d_expert_out, d_weights, None, None, None)`` by ``bwd``: the launcher eagerly, the backward op
    under torch.compile."""
    expert_out, weights, slots = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    d_out, dw = bwd(dy, expert_out, weights.contiguous(), slots, need_dw)
    return d_out, given(dw, need_dw), None, None, None


class MoECombineFunction(torch.autograd.Function):
    """The launchers with :func:`_moe_combine_setup` and :func:`_moe_combine_backward`, the custom op's
    formula too."""

    @staticmethod
    def forward(ctx, *inputs):
        expert_out, weights, *plan = inputs
        y = moe_combine_fwd(expert_out, weights, MoEPlan(*plan))
        _moe_combine_setup(ctx, inputs, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _moe_combine_backward(ctx, dy)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::moe_sort_fwd", mutates_args=())
def moe_sort_fwd_op(indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(expert_offsets, positions, slots)`` of :func:`kernels.moe_permute.moe_sort` (integers: no gradient)."""
    return tuple(eager(moe_sort)(indices, num_experts))


@fake(moe_sort_fwd_op)
def _(indices, num_experts):
    T, k = indices.shape
    i32 = dict(dtype=torch.int32)
    return indices.new_empty(num_experts + 1, **i32), indices.new_empty((T, k), **i32), indices.new_empty(T * k, **i32)


@compiled("moe_sort")
def _compiled_moe_sort(indices: Tensor, num_experts: int) -> MoEPlan:
    return MoEPlan(*moe_sort_fwd_op(indices, num_experts))


@define("tritonllm::moe_gather_fwd", mutates_args=())
def moe_gather_fwd_op(x: Tensor, expert_offsets: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
    """:func:`kernels.moe_permute.moe_gather_fwd` of the plan ``(expert_offsets, positions, slots)``."""
    return moe_gather_fwd(x, MoEPlan(expert_offsets, positions, slots))


@fake(moe_gather_fwd_op)
def _(x, expert_offsets, positions, slots):
    return x.new_empty((slots.shape[0], x.shape[1]))


@define("tritonllm::moe_gather_bwd", mutates_args=())
def moe_gather_bwd_op(d_sorted: Tensor, positions: Tensor) -> Tensor:
    """:func:`kernels.moe_permute.moe_gather_bwd`: each token's k row gradients summed."""
    return moe_gather_bwd(d_sorted, positions)


@fake(moe_gather_bwd_op)
def _(d_sorted, positions):
    return d_sorted.new_empty((positions.shape[0], d_sorted.shape[1]))


register_formula(moe_gather_fwd_op, _moe_gather_setup, _moe_gather_backward, bwd=moe_gather_bwd_op)


@compiled("moe_gather")
def _compiled_moe_gather(x: Tensor, plan: MoEPlan) -> Tensor:
    check_plan(plan)
    return moe_gather_fwd_op(x, *plan)


@define("tritonllm::moe_combine_fwd", mutates_args=())
def moe_combine_fwd_op(expert_out: Tensor, weights: Tensor, expert_offsets: Tensor, positions: Tensor,
                       slots: Tensor) -> Tensor:
    """:func:`kernels.moe_permute.moe_combine_fwd` of the plan ``(expert_offsets, positions, slots)``."""
    return moe_combine_fwd(expert_out, weights, MoEPlan(expert_offsets, positions, slots))


@fake(moe_combine_fwd_op)
def _(expert_out, weights, expert_offsets, positions, slots):
    return expert_out.new_empty((positions.shape[0], expert_out.shape[1]))


@define("tritonllm::moe_combine_bwd", mutates_args=())
def moe_combine_bwd_op(dy: Tensor, expert_out: Tensor, weights: Tensor, slots: Tensor,
                       need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(d_expert_out, d_weights or absent)`` of :func:`kernels.moe_permute.moe_combine_bwd`."""
    d_out, dw = moe_combine_bwd(dy, expert_out, weights.contiguous(), slots, need_dw)
    return d_out, (dw if dw is not None else absent(dy))


@fake(moe_combine_bwd_op)
def _(dy, expert_out, weights, slots, need_dw):
    return dy.new_empty((slots.shape[0], dy.shape[1])), (weights.new_empty(weights.shape) if need_dw else absent(dy))


register_formula(moe_combine_fwd_op, _moe_combine_setup, _moe_combine_backward, bwd=moe_combine_bwd_op)


@compiled("moe_combine")
def _compiled_moe_combine(expert_out: Tensor, weights: Tensor, plan: MoEPlan) -> Tensor:
    check_plan(plan)
    return moe_combine_fwd_op(expert_out, weights, *plan)


@compilable
def moe_gather(x: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """Dispatch: ``x`` ``[T, H]`` -> ``[T k, H]`` with row ``p`` = ``x[slots[p] // k]`` (expert order).

    Backward sums each token's k row gradients: ``dx[t] = sum_j d[positions[t, j]]``.
    """
    check_plan(plan)
    return MoEGatherFunction.apply(x, *plan)


@compilable
def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """Combine: ``y[t] = sum_j weights[t, j] * expert_out[positions[t, j]]``, ``[T, H]``.

    ``expert_out`` is ``[T k, H]`` in expert order, ``weights`` ``[T, k]`` (e.g. fp32 from
    :func:`moe_router`); differentiable in both. The sum is in fp32, in slot order.
    """
    check_plan(plan)
    return MoECombineFunction.apply(expert_out, weights, *plan)
