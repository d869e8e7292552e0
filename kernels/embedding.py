"""Token embedding: a row gather forward, a deterministic segment-sum backward.

Forward, for ids of any shape ``[...]`` (N tokens) and ``weight`` ``[V, D]``::

    out[n, :] = weight[ids[n], :]                      (out: [..., D])

Backward::

    dW[v, :] = sum over n with ids[n] == v of dy[n, :]  (0 for rows no token uses, and for padding_idx)

No float atomics: the token positions are sorted by id once (``torch.sort``, stable: index
bookkeeping, not float math; the keys are cast to int16 when ``V <= 32768``, else int32, so that
the radix sort makes 2 or 4 passes instead of the 8 of int64), so the tokens of one id form a
contiguous segment of the sorted order. One program per (block of ``BLOCK_V`` consecutive ids,
block of columns) finds its ids' token range in the sorted order by binary search, walks it in
chunks of ``CHUNK`` tokens and adds each chunk's ``dy`` rows to its ``[BLOCK_V, BLOCK_D]`` fp32
tile with one ``tl.dot`` against the 0/1 matrix ``onehot[i, j] = (v0 + i == id[j])`` (exact
products). The tile is written once, zeros included: every dW row is written exactly once, no
memset, and the summation order is fixed, so results are bitwise reproducible.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import INDEX_DTYPES, check_dot_dtype, check_same_device, check_tensor, needs_grad
from .launch import Launch, Plans
from .custom_op import compilable, compiled, define, fake, register_formula

#: Forward tile (fixed config, no autotune: the autotuner's per-call key building cost host time on
#: a ~10 us gather): BLOCK_N tokens x BLOCK_D columns per program.
_FWD_BLOCK_N = 16
_FWD_BLOCK_D = 256
_FWD_NUM_WARPS = 4
#: Backward: a program owns _BWD_BLOCK_V consecutive ids x _BWD_BLOCK_D columns of dW and adds
#: _BWD_CHUNK sorted tokens per tl.dot ([BLOCK_V, CHUNK] x [CHUNK, BLOCK_D]; each >= 16).
_BWD_BLOCK_V = 64
_BWD_BLOCK_D = 128
_BWD_CHUNK = 32
_BWD_NUM_WARPS = 4
#: Sort int16 keys when the vocabulary fits (2 radix passes instead of the 4 of int32).
_SORT_INT16 = True


@triton.jit
def _embedding_fwd_kernel(
    ids_ptr,  # [N] token ids, int32 or int64, all in [0, V)
    w_ptr,  # [V, D] weight, last dim contiguous
    out_ptr,  # [N, D] output, contiguous
    N,  # number of tokens
    D,  # embedding dim
    stride_ids,  # ids stride (elements)
    stride_w,  # weight row stride (elements)
    BLOCK_N: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # columns per program
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < N
    mask = row_mask[:, None] & (cols < D)[None, :]
    ids = tl.load(ids_ptr + rows.to(tl.int64) * stride_ids, mask=row_mask, other=0).to(tl.int64)
    vals = tl.load(w_ptr + ids[:, None] * stride_w + cols[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], vals, mask=mask)


@triton.jit
def _embedding_bwd_kernel(
    dy_ptr,  # [N, D] output gradient, last dim contiguous
    sorted_ptr,  # [N] ids sorted ascending (int16 or int32)
    perm_ptr,  # [N] int64: token position of each sorted id
    dw_ptr,  # [V, D] weight gradient output, contiguous: every row written
    N,  # number of tokens
    V,  # vocabulary size
    D,  # embedding dim
    stride_dy,  # dy row stride
    padding_idx,  # id whose rows get no gradient (-1: none)
    SEARCH_STEPS,  # N.bit_length(): binary-search steps that narrow [0, N] to one position
    BLOCK_V: tl.constexpr,  # ids per program
    BLOCK_D: tl.constexpr,  # columns per program
    CHUNK: tl.constexpr,  # sorted tokens per tl.dot
):
    v0 = tl.program_id(0) * BLOCK_V
    # [start, end) = sorted positions of ids in [v0, v0 + BLOCK_V): lower bounds of both, searched together
    bound = tl.arange(0, 2)
    target = v0 + bound * BLOCK_V
    lo = tl.zeros([2], dtype=tl.int32)
    hi = tl.full([2], N, dtype=tl.int32)
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = lo + (hi - lo) // 2
        key = tl.load(sorted_ptr + mid, mask=active, other=0).to(tl.int32)
        right = active & (key < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    start = tl.sum(tl.where(bound == 0, lo, 0))
    end = tl.sum(tl.where(bound == 1, lo, 0))

    v = v0 + tl.arange(0, BLOCK_V)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros([BLOCK_V, BLOCK_D], dtype=tl.float32)
    for j0 in range(start, end, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        valid = j < end
        ids = tl.load(sorted_ptr + j, mask=valid, other=-1).to(tl.int32)
        pos = tl.load(perm_ptr + j, mask=valid, other=0)
        x = tl.load(dy_ptr + pos[:, None] * stride_dy + cols[None, :], mask=valid[:, None] & col_mask[None, :],
                    other=0.0)
        onehot = (v[:, None] == ids[None, :]).to(x.dtype)
        # tf32x3 applies to fp32 dy only (error ~2^-22); half-precision products by 0/1 are exact
        acc = tl.dot(onehot, x, acc, input_precision="tf32x3")
    acc = tl.where((v == padding_idx)[:, None], 0.0, acc)
    tl.store(dw_ptr + v[:, None].to(tl.int64) * D + cols[None, :], acc.to(dw_ptr.dtype.element_ty),
             mask=(v < V)[:, None] & col_mask[None, :])


def padding_index(padding_idx, num_embeddings: int) -> int:
    """``padding_idx`` as a row index in ``[0, V)`` (negative counts from the end), -1 for None."""
    if padding_idx is None:
        return -1
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be None or an int, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx must be in [-{num_embeddings}, {num_embeddings}), got {padding_idx}")
    return padding_idx % num_embeddings


def _check_id_range(ids: torch.Tensor, num_embeddings: int) -> None:
    if ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host sync
        if lo < 0 or hi >= num_embeddings:
            raise ValueError(f"ids must be in [0, {num_embeddings}), got values in [{lo}, {hi}]")


def _check_fwd(ids, weight, validate: bool) -> None:
    check_tensor("weight", weight, ndim=2)
    check_tensor("ids", ids, dtypes=INDEX_DTYPES)
    check_same_device(ids=ids, weight=weight)
    check_dot_dtype("weight", weight)  # the backward's scatter is a tl.dot with a one-hot matrix
    if validate:
        _check_id_range(ids, weight.shape[0])


@functools.lru_cache(maxsize=256)
def _fwd_plan(n: int, d: int, knobs: tuple) -> tuple[int, int, tuple[int, int], int]:
    """``(BLOCK_N, BLOCK_D, grid, num_warps)`` of the forward gather."""
    block_n, block_d, num_warps = knobs
    return block_n, block_d, (triton.cdiv(n, block_n), triton.cdiv(d, block_d)), 1 if interpreting() else num_warps


@functools.lru_cache(maxsize=256)
def _bwd_plan(v: int, d: int, knobs: tuple) -> tuple[int, int, tuple[int, int], int, torch.dtype]:
    """``(BLOCK_V, BLOCK_D, grid, num_warps, sort key dtype)`` of the backward."""
    block_v, block_d, num_warps, int16 = knobs
    block_d = min(block_d, max(16, triton.next_power_of_2(d)))
    key_dtype = torch.int16 if int16 and v <= 2**15 else torch.int32
    return (block_v, block_d, (triton.cdiv(v, block_v), triton.cdiv(d, block_d)), 1 if interpreting() else num_warps,
            key_dtype)


#: forward and backward launch plans per problem (sizes, strides, knobs)
_FWD_PLANS, _BWD_PLANS = Plans(), Plans()


def _fwd(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Unchecked forward: ``weight[ids]`` ``[..., D]``."""
    D = weight.shape[1]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    flat = ids.reshape(-1)  # a view, possibly strided (e.g. of a column ids[:, -1:]): its stride goes to the kernel
    N = flat.shape[0]
    out = torch.empty((N, D), dtype=weight.dtype, device=weight.device)
    if N and D:
        knobs = (_FWD_BLOCK_N, _FWD_BLOCK_D, _FWD_NUM_WARPS)
        key = (N, D, flat.stride(0), weight.stride(0), knobs)
        plan = _FWD_PLANS.get(key)
        if plan is None:
            block_n, block_d, grid, num_warps = _fwd_plan(N, D, knobs)
            plan = _FWD_PLANS.add(key, Launch(_embedding_fwd_kernel, grid, BLOCK_N=block_n, BLOCK_D=block_d,
                                              num_warps=num_warps))
        plan(flat, weight, out, N, D, flat.stride(0), weight.stride(0))
    return out.view(*ids.shape, D)


def _bwd(dy: torch.Tensor, ids: torch.Tensor, num_embeddings: int, pad: int) -> torch.Tensor:
    """Unchecked backward: ``dy`` ``[*ids.shape, D]``, ``pad`` a row index or -1."""
    N, D = ids.numel(), dy.shape[-1]
    block_v, block_d, grid, num_warps, key_dtype = _bwd_plan(
        num_embeddings, D, (_BWD_BLOCK_V, _BWD_BLOCK_D, _BWD_NUM_WARPS, _SORT_INT16))
    dw = torch.empty((num_embeddings, D), dtype=dy.dtype, device=dy.device)
    if num_embeddings and D:
        dy2 = (dy if dy.stride(-1) == 1 else dy.contiguous()).reshape(N, D)
        sorted_ids, perm = torch.sort(ids.reshape(-1).to(key_dtype), stable=True)
        key = (N, num_embeddings, D, dy2.stride(0), pad, block_v, block_d, num_warps, _BWD_CHUNK)
        plan = _BWD_PLANS.get(key) or _BWD_PLANS.add(key, Launch(
            _embedding_bwd_kernel, grid, BLOCK_V=block_v, BLOCK_D=block_d, CHUNK=_BWD_CHUNK, num_warps=num_warps))
        plan(dy2, sorted_ids, perm, dw, N, num_embeddings, D, dy2.stride(0), pad, N.bit_length())
    return dw


def embedding_fwd(ids: torch.Tensor, weight: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """``weight[ids]``: ``[..., D]`` in ``weight``'s dtype (``validate``: see :func:`embedding`)."""
    _check_fwd(ids, weight, validate)
    return _fwd(ids, weight)


def embedding_bwd(dy: torch.Tensor, ids: torch.Tensor, num_embeddings: int,
                  padding_idx: int | None = None) -> torch.Tensor:
    """Weight gradient ``[num_embeddings, D]`` (dtype of ``dy``) of :func:`embedding_fwd`."""
    check_tensor("dy", dy, min_ndim=1)
    check_tensor("ids", ids, dtypes=INDEX_DTYPES)
    check_same_device(dy=dy, ids=ids)
    if tuple(dy.shape) != (*ids.shape, dy.shape[-1]):
        raise ValueError(f"dy must have shape ids.shape + [D] = {tuple(ids.shape)} + [D], got {tuple(dy.shape)}")
    return _bwd_padded(dy, ids, num_embeddings, padding_idx)


def _bwd_padded(dy: torch.Tensor, ids: torch.Tensor, num_embeddings: int, padding_idx: int | None) -> torch.Tensor:
    """Unchecked :func:`embedding_bwd` (``padding_idx`` still checked: it costs nothing on the device)."""
    return _bwd(dy, ids, num_embeddings, padding_index(padding_idx, num_embeddings))


def _embedding_setup(ctx, inputs, output):
    ids, weight, ctx.padding_idx, _ = inputs
    ctx.num_embeddings = weight.shape[0]
    ctx.save_for_backward(ids)


def _embedding_backward(ctx, dy, *, bwd=_bwd_padded):
    """``(None, dweight, None, None)`` by ``bwd``: the unchecked launcher eagerly (the forward checked the
    inputs), the backward op under torch.compile."""
    dw = bwd(dy, ctx.saved_tensors[0], ctx.num_embeddings, ctx.padding_idx) if ctx.needs_input_grad[1] else None
    return None, dw, None, None


class EmbeddingFunction(torch.autograd.Function):
    """Autograd wrapper of the forward / backward launchers (gradient for ``weight`` only). The
    forward checks the inputs; :func:`_embedding_setup` and :func:`_embedding_backward` (the custom
    op's formula too) save the ids and launch the backward unchecked."""

    @staticmethod
    def forward(ctx, *inputs):
        ids, weight, padding_idx, validate = inputs
        _check_fwd(ids, weight, validate)
        padding_index(padding_idx, weight.shape[0])
        out = _fwd(ids, weight)
        _embedding_setup(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, dy):
        return _embedding_backward(ctx, dy)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::embedding_fwd", mutates_args=())
def embedding_fwd_op(ids: Tensor, weight: Tensor, padding_idx: Optional[int], validate: bool) -> Tensor:
    """:func:`kernels.embedding.embedding_fwd`, ``padding_idx`` checked as :func:`kernels.embedding.embedding`."""
    padding_index(padding_idx, weight.shape[0])
    return embedding_fwd(ids, weight, validate)


@fake(embedding_fwd_op)
def _(ids, weight, padding_idx, validate):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@define("tritonllm::embedding_bwd", mutates_args=())
def embedding_bwd_op(dy: Tensor, ids: Tensor, num_embeddings: int, padding_idx: Optional[int]) -> Tensor:
    """:func:`kernels.embedding.embedding_bwd`: the weight gradient."""
    return embedding_bwd(dy, ids, num_embeddings, padding_idx)


@fake(embedding_bwd_op)
def _(dy, ids, num_embeddings, padding_idx):
    return dy.new_empty((num_embeddings, dy.shape[-1]))


register_formula(embedding_fwd_op, _embedding_setup, _embedding_backward, bwd=embedding_bwd_op)


@compiled("embedding")
def _compiled_embedding(ids: Tensor, weight: Tensor, padding_idx: int | None = None, validate: bool = True) -> Tensor:
    return embedding_fwd_op(ids, weight, padding_idx, validate)


@compilable
def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
              validate: bool = True) -> torch.Tensor:
    """Token embedding lookup.

    Args:
        ids: int32/int64 token ids of any shape and strides ``[...]``, all in ``[0, V)``.
        weight: ``[V, D]`` float32/float16/bfloat16 (any row stride).
        padding_idx: optional row (negative counts from the end) that receives no gradient; its
            forward value is ``weight[padding_idx]`` as in ``torch.nn.functional.embedding``.
        validate: check on the host that every id is in ``[0, V)`` (ValueError naming ``ids``
            otherwise): one min/max and one device-to-host sync per call. ``False`` skips it for
            callers that guarantee the range (the training path: the data pipeline checks token
            ranges when it loads a corpus); an id out of range is then undefined behaviour.

    Returns:
        ``out[..., :] = weight[ids[...], :]``, shape ``[..., D]``, dtype of ``weight``. The gradient
        ``dW[v] = sum_{n: ids[n] = v} dy[n]`` (fp32 sums, deterministic, zero for unused rows).
    """
    if needs_grad(weight):
        return EmbeddingFunction.apply(ids, weight, padding_idx, validate)
    _check_fwd(ids, weight, validate)  # nothing to differentiate: no autograd node, the same checks
    padding_index(padding_idx, weight.shape[0])
    return _fwd(ids, weight)
