"""Token embedding: a row gather forward, a deterministic scatter-add backward.

Forward, for ids of any shape ``[...]`` (N tokens) and ``weight`` ``[V, D]``::

    out[n, :] = weight[ids[n], :]                      (out: [..., D])

Backward::

    dW[v, :] = sum over n with ids[n] == v of dy[n, :]  (0 for rows no token uses, and for padding_idx)

No float atomics: the token positions are sorted by id once (``torch.sort``, stable: index
bookkeeping, not float math), so the tokens of one id form a contiguous segment of the sorted order.
The sorted order is cut into chunks of ``CHUNK`` tokens; one program per (chunk, column block)
gathers the chunk's ``dy`` rows and sums each id's rows with one ``tl.dot`` against the 0/1 matrix
``same[r, j] = (id[r] == id[j])`` (fp32 accumulation; exact products since the matrix is 0/1). A
segment lying inside one chunk is written straight to its dW row. A segment crossing chunk
boundaries leaves fp32 partials (its tail piece in the chunk where it starts, its head piece in
each later chunk); a second kernel adds them chunk by chunk in order, so results are bitwise
reproducible. dW starts zero-filled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DTYPES, check_same_device, check_tensor, interpreting, rows_view

# Sorted tokens per backward program (the segment-sum dot is CHUNK x CHUNK x BLOCK_D): longer chunks
# mean fewer crossing segments for the fixup kernel, at CHUNK / 2 wasted MMA flops per dy element.
_CHUNK = 64
# Column block of the fixup kernel (it only touches crossing segments).
_FIXUP_BLOCK_D = 256


def _fwd_configs():
    if interpreting():
        return [triton.Config({"BLOCK_N": 128, "BLOCK_D": 128}, num_warps=1)]
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_D": d}, num_warps=w)
        for n, d, w in ((8, 512, 4), (16, 256, 4), (32, 256, 8), (16, 512, 8), (64, 128, 4), (32, 1024, 8))
    ]


def _bwd_configs():
    if interpreting():
        return [triton.Config({"BLOCK_D": 128}, num_warps=1)]
    return [triton.Config({"BLOCK_D": d}, num_warps=w) for d in (64, 128, 256) for w in (4, 8)]


@triton.autotune(configs=_fwd_configs(), key=["D"])
@triton.jit
def _embedding_fwd_kernel(
    ids_ptr,  # [N] token ids, int32 or int64, all in [0, V)
    w_ptr,  # [V, D] weight, last dim contiguous
    out_ptr,  # [N, D] output, contiguous
    N,  # number of tokens
    D,  # embedding dim
    stride_w,  # weight row stride (elements)
    BLOCK_N: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # columns per program
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < N
    mask = row_mask[:, None] & (cols < D)[None, :]
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    vals = tl.load(w_ptr + ids[:, None] * stride_w + cols[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], vals, mask=mask)


@triton.autotune(configs=_bwd_configs(), key=["D"])
@triton.jit
def _embedding_bwd_kernel(
    dy_ptr,  # [N, D] output gradient, last dim contiguous
    sorted_ptr,  # [N] ids sorted ascending
    perm_ptr,  # [N] int64: token position of each sorted id
    dw_ptr,  # [V, D] weight gradient, zero-filled; rows of segments inside one chunk written here
    head_ptr,  # [num_chunks, D] fp32: sum of the chunk's first segment when it started in an earlier chunk
    tail_ptr,  # [num_chunks, D] fp32: sum of the chunk's last segment when it starts here and goes on
    N,  # number of tokens
    D,  # embedding dim
    stride_dy,  # dy row stride
    stride_dw,  # dW row stride
    padding_idx,  # id whose rows get no gradient (-1: none)
    CHUNK: tl.constexpr,  # sorted tokens per program
    BLOCK_D: tl.constexpr,  # columns per program
):
    chunk = tl.program_id(0)
    start = chunk * CHUNK
    r = tl.arange(0, CHUNK)
    rows = start + r
    valid = rows < N
    ids = tl.load(sorted_ptr + rows, mask=valid, other=-1)
    next_ids = tl.load(sorted_ptr + rows + 1, mask=rows + 1 < N, other=-1)
    before = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-1)  # id just before the chunk
    pos = tl.load(perm_ptr + rows, mask=valid, other=0)

    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = (cols < D)[None, :]
    keep = valid & (ids != padding_idx)
    x = tl.load(dy_ptr + pos[:, None] * stride_dy + cols[None, :], mask=keep[:, None] & col_mask, other=0.0)
    same = (ids[:, None] == ids[None, :]).to(x.dtype)
    # seg[r] = sum of the chunk's rows with id[r]; tf32x3 applies to fp32 dy only (error ~2^-22)
    seg = tl.dot(same, x, input_precision="tf32x3")

    piece_end = valid & ((ids != next_ids) | (r == CHUNK - 1))  # last row of a segment within this chunk
    starts_here = ids != before
    ends_here = ids != next_ids
    dw_offs = ids[:, None].to(tl.int64) * stride_dw + cols[None, :]
    complete = piece_end & starts_here & ends_here  # the whole segment is in this chunk
    tl.store(dw_ptr + dw_offs, seg.to(dw_ptr.dtype.element_ty), mask=complete[:, None] & col_mask)
    part_offs = chunk.to(tl.int64) * D + cols[None, :] + 0 * r[:, None]
    tl.store(head_ptr + part_offs, seg, mask=(piece_end & ~starts_here)[:, None] & col_mask)
    tl.store(tail_ptr + part_offs, seg, mask=(piece_end & starts_here & ~ends_here)[:, None] & col_mask)


@triton.jit
def _embedding_bwd_fixup_kernel(
    sorted_ptr,  # [N] ids sorted ascending
    dw_ptr,  # [V, D] weight gradient
    head_ptr,  # [num_chunks, D] fp32 head partials (see _embedding_bwd_kernel)
    tail_ptr,  # [num_chunks, D] fp32 tail partials
    N,  # number of tokens
    D,  # embedding dim
    stride_dw,  # dW row stride
    CHUNK: tl.constexpr,  # sorted tokens per chunk (as in _embedding_bwd_kernel)
    BLOCK_D: tl.constexpr,  # columns per program
):
    chunk = tl.program_id(0)
    end = (chunk + 1) * CHUNK
    if end < N:
        last = tl.load(sorted_ptr + end - 1)
        before = tl.load(sorted_ptr + chunk * CHUNK - 1, mask=chunk > 0, other=-1)
        more = tl.load(sorted_ptr + end) == last
        if more & (last != before):  # this chunk owns a segment running into the next chunk(s)
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            col_mask = cols < D
            acc = tl.load(tail_ptr + chunk.to(tl.int64) * D + cols, mask=col_mask, other=0.0)
            q = chunk + 1
            while more:
                acc += tl.load(head_ptr + q.to(tl.int64) * D + cols, mask=col_mask, other=0.0)
                q += 1
                more = tl.load(sorted_ptr + q * CHUNK, mask=q * CHUNK < N, other=-1) == last
            tl.store(dw_ptr + last.to(tl.int64) * stride_dw + cols, acc.to(dw_ptr.dtype.element_ty), mask=col_mask)


def _padding_index(padding_idx, num_embeddings: int) -> int:
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


def embedding_fwd(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``: ``[..., D]`` in ``weight``'s dtype."""
    check_tensor("weight", weight, ndim=2)
    check_tensor("ids", ids, dtypes=INDEX_DTYPES)
    check_same_device(ids=ids, weight=weight)
    _check_id_range(ids, weight.shape[0])
    V, D = weight.shape
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    flat = ids.reshape(-1)
    N = flat.numel()
    out = torch.empty((N, D), dtype=weight.dtype, device=weight.device)
    if out.numel():
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(D, meta["BLOCK_D"]))  # noqa: E731
        _embedding_fwd_kernel[grid](flat, weight, out, N, D, weight.stride(0))
    return out.view(*ids.shape, D)


def embedding_bwd(dy: torch.Tensor, ids: torch.Tensor, num_embeddings: int,
                  padding_idx: int | None = None) -> torch.Tensor:
    """Weight gradient ``[num_embeddings, D]`` (dtype of ``dy``) of :func:`embedding_fwd`."""
    check_tensor("dy", dy, min_ndim=1)
    check_tensor("ids", ids, dtypes=INDEX_DTYPES)
    check_same_device(dy=dy, ids=ids)
    if tuple(dy.shape) != (*ids.shape, dy.shape[-1]):
        raise ValueError(f"dy must have shape ids.shape + [D] = {tuple(ids.shape)} + [D], got {tuple(dy.shape)}")
    pad = _padding_index(padding_idx, num_embeddings)
    D = dy.shape[-1]
    dw = torch.zeros((num_embeddings, D), dtype=dy.dtype, device=dy.device)
    N = ids.numel()
    if N == 0 or D == 0:
        return dw
    dy2 = rows_view(dy, D)
    sorted_ids, perm = torch.sort(ids.reshape(-1), stable=True)
    num_chunks = triton.cdiv(N, _CHUNK)
    head = torch.empty((num_chunks, D), dtype=torch.float32, device=dy.device)
    tail = torch.empty_like(head)
    grid = lambda meta: (num_chunks, triton.cdiv(D, meta["BLOCK_D"]))  # noqa: E731
    _embedding_bwd_kernel[grid](dy2, sorted_ids, perm, dw, head, tail, N, D, dy2.stride(0), dw.stride(0), pad,
                                CHUNK=_CHUNK)
    _embedding_bwd_fixup_kernel[(num_chunks, triton.cdiv(D, _FIXUP_BLOCK_D))](
        sorted_ids, dw, head, tail, N, D, dw.stride(0), CHUNK=_CHUNK, BLOCK_D=_FIXUP_BLOCK_D,
    )
    return dw


class EmbeddingFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`embedding_fwd` / :func:`embedding_bwd` (gradient for ``weight`` only)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        out = embedding_fwd(ids, weight)
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        ctx.padding_idx = padding_idx
        return out

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        dw = embedding_bwd(dy, ids, ctx.num_embeddings, ctx.padding_idx) if ctx.needs_input_grad[1] else None
        return None, dw, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """Token embedding lookup.

    Args:
        ids: int32/int64 token ids of any shape ``[...]``, all in ``[0, V)`` (checked on the host:
            one min/max and one device-to-host sync per call).
        weight: ``[V, D]`` float32/float16/bfloat16 (any row stride).
        padding_idx: optional row (negative counts from the end) that receives no gradient; its
            forward value is ``weight[padding_idx]`` as in ``torch.nn.functional.embedding``.

    Returns:
        ``out[..., :] = weight[ids[...], :]``, shape ``[..., D]``, dtype of ``weight``. The gradient
        ``dW[v] = sum_{n: ids[n] = v} dy[n]`` (fp32 sums, deterministic, zero for unused rows).
    """
    check_tensor("weight", weight, ndim=2)
    _padding_index(padding_idx, weight.shape[0])  # reject a bad padding_idx before any work
    return EmbeddingFunction.apply(ids, weight, padding_idx)
