"""Flash attention forward for Hopper (sm90), written in Gluon (Triton's lower-level language):
FlashAttention-3's warp-specialized schedule on a persistent grid.

- A producer warp fills a ring of k and v tiles (TMA, mbarriers both ways); two consumer warpgroups of
  64 query rows each take turns at the tensor cores (each waits for its turn before issuing a tile's
  products and then passes the turn), so that one's softmax runs while the other's products do. Each
  consumer keeps the score product of the next key tile in flight during this tile's softmax:

      issue S_j = q k_j^T                  (async)
      issue O += P_{j-1} v_{j-1}           (async)
      wait S_j; mask; online softmax -> P_j, alpha_j   (overlaps the value product)
      wait O; O *= alpha_j

- One program an SM runs a list of query tiles that the host balanced (:func:`schedule`), so that the
  producer loads the next tile's q, k and v while the consumers finish this one (its last value product
  and the output store), and the launch, the descriptors and the first loads' latency are paid once an
  SM instead of once a tile.

The same math as :func:`forward._attend` (base-2 online softmax, scores scaled inside the exponent),
so the output and the natural-log ``lse`` are the portable kernel's, to rounding. Only 16-bit q, k, v
on sm90, head dim 64 or 128, with or without the causal mask, no window and no documents
(:func:`supported`); ``AttentionSettings.sm90_fwd`` names the head dims it runs (64 and 128 by default, see the setting).
"""

from __future__ import annotations

import functools
import heapq

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ..device import num_sms
from ..launch import autotune, next_pow2
from ..scratch import tma_scratch

#: (BLOCK_M, BLOCK_N, num_warps, NUM_BUF): the kernel's one config (num_warps 4 is the first consumer's; the
#: kernel runs 12: two consumer warpgroups and the producer warp; BLOCK_M must be SCHED_BLOCK_M). Measured
#: on an H100 (scripts/attention_sm90.py, docs/perf/attention-sm90-h100.json): a ring of 3 ran within 1% of
#: it at the four bench shapes, 64-key tiles 7-14% slower, and the one-tile-a-program schedules (warp-specialized
#: or not) 1.1-1.6x slower at every shape; they were removed.
CONFIGS = [(128, 128, 4, 2)]
#: the query tile: :func:`schedule`'s tiles
SCHED_BLOCK_M = 128
#: :func:`schedule`'s cost of a tile beyond its key tiles, in key tiles of SCHED_BLOCK_M keys (the first
#: score product, which nothing overlaps, and the output store)
SCHED_TILE_COST = 1.0


@gluon.constexpr_function
def wgmma_layout(num_warps, n):
    """The register layout of a wgmma result with n columns over ``num_warps`` warps (64 rows a warpgroup)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def descriptor4(ptr, batch, heads, rows, stride_b, stride_h, stride_row, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A TMA descriptor of a [batch, heads, rows, HEAD_DIM] view with [1, 1, ROWS, HEAD_DIM] blocks; rows past
    ``rows`` read as zeros."""
    layout4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return tma.make_tensor_descriptor(ptr, shape=[batch, heads, rows, HEAD_DIM],
                                      strides=[stride_b, stride_h, stride_row, 1],
                                      block_shape=[1, 1, ROWS, HEAD_DIM], layout=layout4)


@gluon.jit
def _bounds(m0, ROWS: gl.constexpr, T, S, shift, layout: gl.constexpr, CAUSAL: gl.constexpr):
    """For query rows m0 .. m0 + ROWS (``layout``: the scores' row slice): ``(rows, row_end, full_end)``:
    each row sees keys [0, row_end) (:func:`_key_tiles`: the tiles the rows visit together); tiles that
    start at or after full_end - BLOCK_N + 1 need the mask (the causal edge, keys past S)."""
    rows = m0 + gl.arange(0, ROWS, layout=layout)
    if CAUSAL:
        # rows past T take row T - 1's end: they are never stored and must not widen the loop
        row_end = gl.minimum(gl.minimum(rows, T - 1) + shift + 1, S)
        full_end = gl.minimum(m0 + shift + 1, S)
    else:
        row_end = gl.zeros_like(rows) + S
        full_end = S
    return rows, row_end, full_end


@gluon.jit
def _start(ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr):
    """A consumer's loop state in the wgmma layouts of NW warps: ``(s_zero, acc, m, l, cols0)``; a row
    starts at a finite max, so that one whose first tiles are all masked gets p = 0 and alpha = 1."""
    s_layout: gl.constexpr = wgmma_layout(NW, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(NW, HEAD_DIM)
    return (gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout),
            gl.full([ROWS], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout)),
            gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout)),
            gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)))


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, start_n, full_end, row_end, cols0):
    """One key tile (keys start_n + cols0) of the base-2 online softmax: the masked scores ``s`` ->
    ``(p, alpha, m, l)`` (p fp32 in s's layout, alpha the factor on the earlier accumulator)."""
    if start_n + cols0.shape[0] > full_end:
        s = gl.where((start_n + cols0)[None, :] < row_end[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _store_rows(acc, l_i, m_i, rows, O, LSE, b, h, T, HQ, HEAD_DIM: gl.constexpr):
    """o = acc / l and the natural-log lse of ``rows`` (rows with no key: o = 0, lse = -inf)."""
    o_layout: gl.constexpr = acc.type.layout
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_offs = ((b * T + o_rows) * HQ + h)[:, None] * HEAD_DIM + o_cols[None, :]
    gl.store(O + o_offs, out.to(O.dtype.element_ty), mask=(o_rows < T)[:, None])
    gl.store(LSE + (b * HQ + h) * T + rows, lse, mask=rows < T)


@gluon.jit
def _sm90_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    B, T, S, HQ, GROUP, shift, qk_scale,
    SCHED, sched_pitch,         # schedule()'s table, int32 [programs, sched_pitch]
    T_BUCKET, S_BUCKET,         # next_pow2(T), next_pow2(S): autotune keys only
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    # [B, H, T, D] views of the tensors, which serve every tile of the program
    q_desc = descriptor4(Q, B, HQ, T, stride_qb, stride_qh, stride_qt, BLOCK_M // 2, HEAD_DIM)
    k_desc = descriptor4(K, B, HQ // GROUP, S, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM)
    v_desc = descriptor4(V, B, HQ // GROUP, S, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM)
    _ws_body(q_desc, k_desc, v_desc, O, LSE, SCHED + gl.program_id(0) * sched_pitch, T, S, HQ, GROUP, shift,
             qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL)


@gluon.jit
def _key_tiles(m0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, T, S, shift, CAUSAL: gl.constexpr):
    """The key tiles that query rows m0 .. m0 + BLOCK_M visit (at least one: a block that sees no key
    still runs one, fully masked, so that its rows get o = 0 and lse = -inf)."""
    if CAUSAL:
        hi = gl.minimum(gl.minimum(m0 + BLOCK_M, T) + shift, S)
    else:
        hi = S
    return gl.maximum(gl.cdiv(hi, BLOCK_N), 1)


@gluon.jit
def _tile(tiles, t, T, HQ, GROUP, BLOCK_M: gl.constexpr):
    """The program's t-th query tile (``tiles``: its row of the schedule, the count first):
    ``(b, h, hk, m0)`` (query head h, its KV head hk, rows m0 ..)."""
    n_tiles = gl.cdiv(T, BLOCK_M)
    code = gl.load(tiles + 1 + t)
    rank = code % n_tiles
    pid_bh = code // n_tiles
    h = pid_bh % HQ
    return pid_bh // HQ, h, h // GROUP, (n_tiles - 1 - rank) * BLOCK_M  # last query blocks first (causal)


@gluon.jit
def _ws_body(q_desc, k_desc, v_desc, O, LSE, tiles, T, S, HQ, GROUP, shift, qk_scale, HEAD_DIM: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr):
    """The shared memory and barriers, then the three partitions, which run the program's query tiles
    (:func:`_tile`; ``tiles``: the program's row of the schedule) in turn. Each k and v slot is freed by both consumers (count 2), and so are the q
    tiles (``q_empty``, once their last score product is done, so that the next tile's q loads under this
    tile's last value product and store); ``turn[c]`` says consumer c may issue its products."""
    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], tile_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    smem = (q_smem, k_smem, v_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn)
    problem = (O, LSE, tiles, T, S, HQ, GROUP, shift, qk_scale)
    gl.warp_specialize([
        (_ws_consumer, (smem, bars, problem, 0, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL)),
        (_ws_consumer, (smem, bars, problem, 1, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL)),
        (_ws_producer, (q_desc, k_desc, v_desc, smem, bars, problem, BLOCK_M, BLOCK_N, CAUSAL)),
    ], [4, 1], [232, 40])  # registers (setmaxnreg) of the second consumer and the producer; the first gets the rest


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, smem, bars, problem, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """One warp: per query tile, both consumers' q rows once they freed the last tile's, then tile after
    tile of k and v into the ring (its slots counted across the program's tiles), each slot once both
    consumers have freed it."""
    q_smem, k_smem, v_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
    O, LSE, tiles, T, S, HQ, GROUP, shift, qk_scale = problem
    NUM_BUF: gl.constexpr = k_smem.type.shape[0]
    HALF: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    kv = 0
    for t in range(gl.load(tiles)):
        b, h, hk, m0 = _tile(tiles, t, T, HQ, GROUP, BLOCK_M)
        mbarrier.wait(q_empty, (t & 1) ^ 1)  # free at the first tile
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready, q_smem.index(0).reshape([1, 1, HALF, HEAD_DIM]))
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + HALF, 0], q_ready,
                                        q_smem.index(1).reshape([1, 1, HALF, HEAD_DIM]))
        n_iter = _key_tiles(m0, BLOCK_M, BLOCK_N, T, S, shift, CAUSAL)
        for j in range(n_iter):
            s = kv % NUM_BUF
            free = ((kv // NUM_BUF) & 1) ^ 1  # a slot starts free: its first wait passes at once
            mbarrier.wait(k_empty.index(s), free)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s),
                                            k_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]))
            mbarrier.wait(v_empty.index(s), free)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s),
                                            v_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]))
            kv += 1


@gluon.jit
def _ws_consumer(smem, bars, problem, C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Consumer C (a warpgroup): per query tile, rows m0 + 64 C .. + 64 over every key tile of the block.
    Before issuing a key tile's products it waits for its turn and then hands the turn to the other
    consumer, so that one's softmax runs while the other's products do (FlashAttention-3's ping-pong);
    the turns and ring slots are counted across the program's tiles (``kv``)."""
    q_smem, k_smem, v_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
    O, LSE, tiles, T, S, HQ, GROUP, shift, qk_scale = problem
    NUM_BUF: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(C)
    kv = 0
    for t in range(gl.load(tiles)):
        b, h, hk, m0 = _tile(tiles, t, T, HQ, GROUP, BLOCK_M)
        n_iter = _key_tiles(m0, BLOCK_M, BLOCK_N, T, S, shift, CAUSAL)
        s_zero, acc, m_i, l_i, cols0 = _start(ROWS, BLOCK_N, HEAD_DIM, 4)
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = m_i.type.layout
        rows, row_end, full_end = _bounds(m0 + C * ROWS, ROWS, T, S, shift, row_layout, CAUSAL)

        mbarrier.wait(q_ready, t & 1)
        mbarrier.wait(turn.index(C), (kv & 1) ^ (1 - C))  # consumer 0 goes first
        mbarrier.wait(k_ready.index(kv % NUM_BUF), (kv // NUM_BUF) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(kv % NUM_BUF).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - C), count=1)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(kv % NUM_BUF), count=1)
        p32, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale, 0, full_end, row_end, cols0)
        p = gl.convert_layout(p32.to(dtype), p_layout)

        for i in range(1, n_iter):
            g = kv + i
            cs = g % NUM_BUF
            ps = (g - 1) % NUM_BUF
            mbarrier.wait(turn.index(C), (g & 1) ^ (1 - C))
            mbarrier.wait(k_ready.index(cs), (g // NUM_BUF) & 1)
            s_tok = warpgroup_mma(q, k_smem.index(cs).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(ps), ((g - 1) // NUM_BUF) & 1)
            o_tok = warpgroup_mma(p, v_smem.index(ps), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - C), count=1)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(cs), count=1)
            p32, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale, i * BLOCK_N, full_end, row_end, cols0)
            acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
            mbarrier.arrive(v_empty.index(ps), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p = gl.convert_layout(p32.to(dtype), p_layout)

        mbarrier.arrive(q_empty, count=1)  # every score product of the tile is done
        kv += n_iter
        ls = (kv - 1) % NUM_BUF
        mbarrier.wait(v_ready.index(ls), ((kv - 1) // NUM_BUF) & 1)
        acc = warpgroup_mma(p, v_smem.index(ls), acc)
        mbarrier.arrive(v_empty.index(ls), count=1)
        _store_rows(acc, l_i, m_i, rows, O, LSE, b.to(gl.int64), h.to(gl.int64), T, HQ, HEAD_DIM)


_kernel = autotune([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "NUM_BUF": nb}, num_warps=w, num_stages=1)
                    for bm, bn, w, nb in CONFIGS],
                   key=["T_BUCKET", "S_BUCKET", "HEAD_DIM", "CAUSAL"])(_sm90_fwd_kernel)
assert all(bm == SCHED_BLOCK_M for bm, *_ in CONFIGS), "schedule() plans SCHED_BLOCK_M tiles"


@functools.lru_cache(maxsize=64)
def schedule(B: int, Hq: int, T: int, S: int, causal: bool, programs: int, group_programs: int,
             device: torch.device) -> torch.Tensor:
    """The programs' query tiles: int32 ``[P, 1 + L]``, row p program p's count n, then its n tiles
    (``pid_bh * n_tiles + rank`` of the query tiles of SCHED_BLOCK_M rows; the rest of the row unused).

    The tiles come in :func:`masks.program_tile`'s order (groups of about ``group_programs`` tiles, the
    longest causal tiles first in each), and each goes to the program that would be free first (a program's
    load: the key tiles of its tiles, plus SCHED_TILE_COST each; ties to the lower program): the greedy
    list schedule that the hardware gives a one-tile-a-program grid, without its cost per program. P is
    ``min(programs, tiles)``. Cached per problem (the training step calls it with a handful)."""
    n_tiles = triton.cdiv(T, SCHED_BLOCK_M)
    n_bh = B * Hq
    heads_per_group = max(group_programs // n_tiles, 1)
    per_group = heads_per_group * n_tiles
    P = min(programs, n_tiles * n_bh)
    loads = [(0.0, p) for p in range(P)]
    rows: list[list[int]] = [[] for _ in range(P)]
    for pid in range(n_tiles * n_bh):
        group, r = divmod(pid, per_group)
        heads = min(n_bh - group * heads_per_group, heads_per_group)
        rank, pid_bh = r // heads, group * heads_per_group + r % heads
        m0 = (n_tiles - 1 - rank) * SCHED_BLOCK_M
        keys = min(min(m0 + SCHED_BLOCK_M, T) + S - T, S) if causal else S
        load, p = heapq.heappop(loads)
        heapq.heappush(loads, (load + max(keys, 1) / SCHED_BLOCK_M + SCHED_TILE_COST, p))
        rows[p].append(pid_bh * n_tiles + rank)
    width = 1 + max(len(r) for r in rows)
    table = torch.zeros(P, width, dtype=torch.int32)
    for p, r in enumerate(rows):
        table[p, 0] = len(r)
        table[p, 1:1 + len(r)] = torch.tensor(r, dtype=torch.int32)
    return table.to(device)


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    """A Hopper GPU (H100, H200): what the Gluon kernels are written for."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window, documents) -> bool:
    """This kernel computes the forward of these inputs: 16-bit on an sm90 GPU, head dim 64 or 128, no
    window or documents, TMA-addressable k and v (16-byte aligned base and strides)."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and window is None
            and documents is None and _sm90(q.device)
            and all(t.data_ptr() % 16 == 0 and all(st * 2 % 16 == 0 for st in t.stride()[:3]) for t in (q, k, v)))


def launch(q, k, v, o, lse, causal: bool, qk_scale: float, group_programs: int, key, config=None) -> None:
    """Run the kernel into ``o`` [B, T, Hq, D] and ``lse`` [B, Hq, T]; ``key`` determines the shapes,
    strides and flags (the launch plan's key, see :meth:`launch._Autotuned.launch`). ``config``: one
    of :data:`CONFIGS`, launched as it is instead (scripts/attention_sm90.py times them one by one)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    sched = schedule(B, Hq, T, S, causal, num_sms(q.device.index), group_programs, q.device)
    grid = (sched.shape[0],)
    triton.set_allocator(tma_scratch)  # the in-kernel descriptors' scratch; per call: the allocator is per thread
    args = (q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), B, T, S, Hq, Hq // Hkv, S - T, qk_scale,
            sched, sched.shape[1], next_pow2(T), next_pow2(S))
    if config is None:
        _kernel.launch(key, grid, *args, HEAD_DIM=D, CAUSAL=causal)
    else:
        bm, bn, w, nb = config
        _sm90_fwd_kernel[grid](*args, HEAD_DIM=D, CAUSAL=causal, num_warps=w, BLOCK_M=bm, BLOCK_N=bn, NUM_BUF=nb)
