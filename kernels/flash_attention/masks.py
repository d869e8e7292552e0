"""Device helpers of the attention kernels: the per-row key / query intervals that the causal, window
and document masks reduce to, the loop segments they give, and a row-block program's coordinates."""

import triton
import triton.language as tl

# Masks are per-row intervals: query i sees keys [first_i, end_i) (computed once per program), so
# a masked tile costs two compares. Helpers are called per program or per loop segment, never per
# tile (each jit-helper call re-patches triton.language under the interpreter, about 3 ms).

@triton.jit
def keys_seen(q_pos, key_end, shift, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Keys [first, end) seen by queries at ``q_pos``: causal bottom-right (j <= i + shift with
    shift = S - T), window (j > i + shift - window), below ``key_end``. May be empty (end <= first)."""
    first = tl.zeros_like(q_pos)
    end = tl.zeros_like(q_pos) + key_end
    if CAUSAL:
        end = tl.minimum(end, q_pos + shift + 1)
    if HAS_WINDOW:
        first = tl.maximum(first, q_pos + shift - window + 1)
    return first, end


@triton.jit
def queries_seeing(k_pos, T, shift, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Queries [first, end) that see the keys at ``k_pos``: the inverse of :func:`keys_seen`."""
    first = tl.zeros_like(k_pos)
    end = tl.zeros_like(k_pos) + T
    if CAUSAL:
        first = tl.maximum(first, k_pos - shift)
    if HAS_WINDOW:
        end = tl.minimum(end, k_pos - shift + window)
    return first, end


@triton.jit
def in_document(first, end, DOCS_row, pos):
    """[first, end) cut to the document of each position ``pos``: ``DOCS_row`` points to one batch
    row's ``[T, 2]`` int32 bounds (the document's first position, one past its last). Queries and keys
    share positions (T == S), so the same bounds serve both sides."""
    pos64 = pos.to(tl.int64) * 2
    return tl.maximum(first, tl.load(DOCS_row + pos64)), tl.minimum(end, tl.load(DOCS_row + pos64 + 1))


@triton.jit
def segments(first, end, BLOCK: tl.constexpr):
    """Tile starts of the loop over the other side, from per-row intervals [first, end):
    ``lo <= full_lo <= full_hi <= hi``. Tiles in [lo, full_lo) and [full_hi, hi) need the mask,
    tiles in [full_lo, full_hi) are visible to every row (no mask), tiles outside are skipped.
    Starts are multiples of BLOCK; only non-negative numbers are divided."""
    lo = tl.min(first, 0) // BLOCK * BLOCK
    hi = tl.maximum(tl.max(end, 0), lo)
    full_lo = tl.minimum((tl.max(first, 0) + BLOCK - 1) // BLOCK * BLOCK, hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(tl.min(end, 0), 0) // BLOCK * BLOCK, full_lo), hi)
    return lo, full_lo, full_hi, hi



@triton.jit
def program_tile(pid, n_tiles, n_heads, group_programs):
    """(rank, head) of tile ``pid`` of ``n_tiles * n_heads`` (a 1-D grid's program id, or a persistent
    program's next tile): the (batch, head) pairs are taken in groups of about ``group_programs`` tiles
    (whole pairs, at least one), and inside a group rank-major (rank 0 of every pair, then rank 1, ...).
    The caller maps rank 0 to its most expensive tile, so that the longest programs start first and the
    short ones fill the end (causal tiles differ in work up to n_tiles-fold); small groups keep the pairs
    whose tensors are streamed at once few (L2)."""
    heads_per_group = tl.maximum(group_programs // n_tiles, 1)
    per_group = heads_per_group * n_tiles
    group = pid // per_group
    first = group * heads_per_group
    heads = tl.minimum(n_heads - first, heads_per_group)
    r = pid - group * per_group
    return r // heads, first + r % heads


@triton.jit
def row_block(T, HQ, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """(b, h, rows, d, row mask, tile mask) of a program over grid (row blocks of T, B * HQ)."""
    pid_bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    return ((pid_bh // HQ).to(tl.int64), (pid_bh % HQ).to(tl.int64), offs_m, offs_d, row_ok,
            row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
