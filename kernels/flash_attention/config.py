"""Flash attention's knobs (tile configs, TMA, one loop, split-KV), their autotuning, and the host-side
checks and flags the forward and backward launchers share."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .._interpreter import interpreting
from ..checks import check_dot_dtype, check_same_device, check_same_dtype, check_tensor
from ..device import num_sms, smem_budget
from ..launch import autotune, next_pow2
from ..scratch import tma_scratch

#: head dimensions the kernels support (96 is padded to 128 inside the kernel with masks).
HEAD_DIMS = (32, 64, 96, 128, 256)

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
POS_INF: tl.constexpr = tl.constexpr(float("inf"))

# Split-KV (decode) path, knobs for the lead to tune on the GPU:
SPLIT_MAX_T = 16          # always use the split-KV kernel for T <= this
SPLIT_WAVES = 4           # aim for this many programs per SM over the splits
SPLIT_MIN_KEYS = 256      # fewest keys one split should read
SPLIT_MAX_ROWS = 64       # largest M tile of (query head, query row) pairs in the split kernel
COMBINE_ROWS = 16         # (b, h, t) rows per program of the split-combine kernel
INTERP_COMBINE_ROWS = 64  # the same under the interpreter (fewer programs)
PREPROCESS_BLOCK_M = 64   # rows per program of the delta = rowsum(dO * O) kernel
#: shared memory the estimate leaves out: it counts operand tiles only, so 27 KiB of the device's
#: budget (:func:`smem_budget`) stay for layout conversions and barriers
SMEM_RESERVE = 27 * 1024
TUNE_MIN_PAIRS = 1 << 20  # autotune prefill/backward only from next_pow2(T) * next_pow2(S) >= this

# Prefill/backward knobs, timed side by side by scripts/tune_attention.py on the GPU (not yet measured):
#: per kernel: stream the K/V tiles (forward, dQ) or the Q/dO tiles and lse/delta rows (dK/dV) through
#: tensor descriptors (TMA) where the device (sm90+), the dtype (16-bit) and the strides (16-byte
#: aligned) allow
TMA = {"fwd": True, "dkdv": True, "dq": True}
#: ... and only where the streamed tensor's length (rounded up to a power of two) times the head dim
#: reaches this on the GPU: below it a program's loop is short and narrow, and building its descriptors
#: costs more than TMA saves. H100, scripts/tune_attention.py, causal, pointer loads against TMA:
#: B16 Hq12 T1024 D64 (void125m's attention) 1.12x in the forward and the dK/dV kernel, 1.00x in dQ
#: (1.13x forward on an H200 too); B4 Hq12 T4096 D64 0.96x / 0.96x / 0.95x; B16 Hq12 T1024 D128
#: 0.98x / 1.00x / 0.97x. Under the interpreter TMA is used wherever allowed (tests' small shapes).
TMA_MIN_ELEMS = 1 << 17
#: per kernel and mask kind ("causal": every call without a window): one pipelined loop whose edge
#: tiles take a masking branch (True) instead of three loops with a pipeline prologue each (False);
#: short loops (sliding window: ~9 tiles) should gain. One loop also needs fewer registers (Triton 3.6,
#: sm90, first configs, TMA, D128: forward 232 -> 190, dQ 192 -> 179, dK/dV spills 336 -> 96 bytes)
ONE_LOOP = {"fwd": {"causal": True, "window": True},
            "dkdv": {"causal": True, "window": True},
            "dq": {"causal": True, "window": True}}
#: per kernel: the order of the programs (:func:`masks.program_tile`): the (batch, head) pairs in groups of
#: about this many waves of programs (x #SMs, whole pairs, at least one), and inside a group every pair's
#: most expensive tile first (causal: the last query tile in the forward and dQ, the first key tile in
#: dK/dV), then the next. None: all pairs in one group (the longest programs of the whole grid first);
#: 0: one pair after another (the order before). H100, scripts/tune_attention.py, pairs per group 1 / 8 /
#: all: dK/dV, whose programs are few and long (a KV head's query heads in one program), needs all:
#: 0.442 / 0.302 / 0.304 ms at B4 Hq16/Hkv4 T2048 D128, 4.76 / 4.61 / 4.29 at B8 Hq32/Hkv8 T4096 D128, and
#: 7.33 / - / 7.42 at B1 Hq32/Hkv8 T16384 (equal). The forward and dQ, many short programs sharing K/V
#: tiles in L2, want about two waves a group: forward 0.188 / 0.179 / 0.185, 2.53 / 2.47 / 2.74 and
#: 4.05 / 4.40 / 4.54 ms (T16384: one pair is 256 programs, two waves); dQ 0.235 / 0.220 / 0.220,
#: 2.98 / 2.98 / 3.25 and 5.23 / 5.11 / 5.02 ms at the same shapes.
GROUP_WAVES: dict[str, float | None] = {"fwd": 2, "dkdv": None, "dq": 2}
#: the head dims at which the forward on Hopper runs forward_sm90's Gluon kernel (wherever it applies,
#: :func:`forward_sm90.supported`); the portable kernel runs every other forward, and everywhere with ``()``.
#: On an H100 (CUDA graphs, docs/perf/NOTES.md, 142f866) its persistent warp-specialized config ran the
#: bench's D128 shapes at 1.08x / 1.02x / 1.12x cuDNN (B4 Hq16/Hkv4 T2048, B8 Hq32/Hkv8 T4096, B1 T16384; 0.138 /
#: 2.007 / 3.444 ms), and B16 Hq12 T1024 D64 at 0.0955 ms against the portable kernel's 0.1022 in one run
#: (scripts/attention_sm90.py; autotuned in the bench 0.0984 against 0.0997; cuDNN 0.086).
SM90_FWD: tuple[int, ...] = (64, 128)
#: per gradient kernel of the deterministic backward ("dkdv", "dq"), the head dims at which it runs
#: backward_sm90's Gluon kernel on Hopper (wherever they apply, :func:`backward_sm90.matrix_args`);
#: ``()``: the portable kernel. Both give bitwise the same gradients. H100, each kernel alone in CUDA
#: graphs (scripts/attention_sm90.py, docs/perf/attention-sm90-h100.json): the Gluon dK/dV (best config)
#: ran 1.02x / 1.15x / 1.14x the portable one at B8 Hq32/Hkv8 T4096, B1 T16384, B4 Hq16/Hkv4 T2048 D128
#: (4.26 / 7.11 / 0.262 ms), 0.88x at B16 Hq12 T1024 D64; the Gluon dQ's 64x64 4-warp tile (two programs an
#: SM) 1.08x / 1.09x / 1.05x at those D128 shapes (2.83 / 4.99 / 0.214 ms), 0.91x at D64. The dQ made persistent
#: (a01a1ec, 74286c6): 1.05x the portable one at D64 (0.112 against 0.117 ms, in both runs), 1.13x / 1.10x / 1.09x
#: at the D128 shapes; dK/dV made persistent too ran 0.97x / 0.99x its one-item programs at T4096 / T2048 D128
#: (more spills) and 0.98x the portable kernel at D64: not kept.
SM90_BWD: dict[str, tuple[int, ...]] = {"dkdv": (128,), "dq": (64, 128)}
#: the head dims at which ``deterministic=False`` runs on Hopper as backward_sm90's dK/dV kernel with DQ_REDUCE
#: (dQ added by a writer warp's TMA bulk reduces; FlashAttention-3's arrangement) instead of the portable fused
#: kernel. Off until measured: the same kernel without the writer warp (each reduce between CTA barriers of
#: the compute warps) ran 0.71x the deterministic Gluon pair at B8 Hq32/Hkv8 T4096 D128 (NOTES.md).
SM90_FUSED: tuple[int, ...] = ()
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner tries; the first that fits is the pinned
#: config (TRITONLLM_NO_AUTOTUNE=1), the last the fallback of fp32 and small problems.
#: Forward: q tile resident, k/v tiles pipelined (Hopper: M 64 per warpgroup, so BLOCK_M 128 = 8 warps).
#: first entry = the config used without autotuning. 64x64 w4 s3 was the fastest forward at every
#: tuned shape on an H200 (scripts/tune_attention.py: 1.24x the 128x128 w8 s2 tile at B8 Hq32/Hkv8 T4096 D128).
FWD_CONFIGS = [(64, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 32, 4, 2)]
#: dK/dV: k/v tiles (BLOCK_N keys) resident, q/dO tiles (BLOCK_M queries) pipelined. Triton 3.6 sm90
#: compile (TMA, one loop), registers / spill bytes per thread at D128 and D64: 32x128 w8 s2 255/0,
#: 131/0; 64x128 w8 s2 (FlashAttention-2's tile) 255/136, 216/0 (the dK, dV accumulators alone take
#: 128 registers at D128); Triton's tutorial tile 32x128 w4 s5 spills at both (768, 136): left out.
#: 64x128 w8 s3 first: 1.37x / 1.29x the 32x128 w8 s2 tile at B8 Hq32/Hkv8 T4096 D128 / B16 Hq12 T1024 D64
#: on an H100 (scripts/tune_attention.py), spills and all.
DKDV_CONFIGS = [(64, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3), (16, 64, 4, 2)]
#: dQ: q/dO tiles resident, k/v tiles pipelined (128x32 4 warps 5 stages: Triton's tutorial; spills
#: 32 bytes at D128)
#: 128x64 w8 s3 first: 1.16x the 128x64 w8 s2 tile at B8 Hq32/Hkv8 T4096 D128 on an H200 (tune_attention.py)
DQ_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2)]


# ----------------------------------------------------------------------------- tuning
# Under the interpreter each kernel gets one fixed config; BLOCK_M != BLOCK_N there so that tile
# edges of queries and keys fall differently. On the GPU: the short lists FWD_CONFIGS, DKDV_CONFIGS,
# DQ_CONFIGS (every autotuned key compiles each config: the lists are kept small so a benchmark run
# does not spend its time compiling), pruned per head dim and dtype, keyed on the head dim, the mask
# kind and the lengths rounded to powers of two. With TRITONLLM_NO_AUTOTUNE=1 (the test suite) each
# kernel runs the first config the pruning keeps (see ``launch.autotune``).

def tuned(kernel, interp: dict, gpu: list[tuple[dict, int, int]], key: list[str], smem_elems, reg_elems):
    """``kernel`` autotuned over ``gpu`` = [(block sizes, num_warps, num_stages)], keyed on ``key``.

    A config is kept when its planned shared memory ``smem_elems(blocks, BLOCK_D, stages)`` times the
    element size fits the budget and the fp32 tiles live in its loop, ``reg_elems(blocks, BLOCK_D)``
    elements, need at most 192 registers per thread. fp32 inputs (the exact, slow path) and problems
    under ``TUNE_MIN_PAIRS`` (rounded T x S) keep only the smallest config: nothing to gain from
    compiling and timing the others. Under the interpreter: the single config ``interp``.
    """
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        bd, esize, budget = args["BLOCK_D"], args["Q"].element_size(), smem_budget(SMEM_RESERVE)
        kept = [c for c in configs if smem_elems(c.kwargs, bd, c.num_stages) * esize <= budget
                and reg_elems(c.kwargs, bd) <= 192 * 32 * c.num_warps] or configs[-1:]
        small = "T_BUCKET" in args and args["T_BUCKET"] * args["S_BUCKET"] < TUNE_MIN_PAIRS
        return kept[-1:] if esize == 4 or small else kept

    if interpreting():
        configs = [triton.Config(interp, num_warps=1, num_stages=1)]
    else:
        configs = [triton.Config(blocks, num_warps=w, num_stages=s) for blocks, w, s in gpu]
    return autotune(configs, key=key, prune_configs_by={"early_config_prune": prune})(kernel)


def block_configs(configs: list[tuple[int, int, int, int]]) -> list[tuple[dict, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples as ``tuned`` wants them."""
    return [({"BLOCK_M": bm, "BLOCK_N": bn}, w, st) for bm, bn, w, st in configs]


KEYS = ["T_BUCKET", "S_BUCKET", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "USE_TMA", "ONE_LOOP", "HAS_DOCS"]

# ----------------------------------------------------------------------------- launchers

def check_documents(documents, q: torch.Tensor, k: torch.Tensor) -> None:
    """``documents``: None or int32 ``[B, T, 2]`` bounds on the device of q, with T == S."""
    if documents is None:
        return
    check_tensor("documents", documents, dtypes=(torch.int32,), ndim=3)
    check_same_device(q=q, documents=documents)
    B, T = q.shape[:2]
    if k.shape[1] != T:
        raise ValueError(f"documents needs as many keys as queries (packed sequences), got T={T} and S={k.shape[1]}")
    if documents.shape != (B, T, 2):
        raise ValueError(f"documents must have shape {(B, T, 2)} [B, T, 2], got {tuple(documents.shape)}")


def check_attention_inputs(q, k, v, causal, window, softmax_scale) -> float:
    """Validate q, k, v and the options; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    check_same_device(q=q, k=k, v=v)
    check_same_dtype(q=q, k=k, v=v)
    check_dot_dtype("q", q)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, S, Hkv, D], got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    B, T, Hq, D = q.shape
    Bk, S, Hkv, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q and k, v must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if Dk != D:
        raise ValueError(f"q and k, v must have the same head dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"q and k, v must be non-empty, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim D={D} of q, k, v is not supported; expected one of {HEAD_DIMS}")
    if Hq % Hkv != 0:
        raise ValueError(f"the Hq={Hq} heads of q must be a multiple of the Hkv={Hkv} heads of k and v")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys each query sees, itself included), got {window}")
        if not causal:
            raise ValueError("window requires causal=True (a sliding window looks back from each query)")
    if softmax_scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0 or None (1/sqrt(D)), got {softmax_scale!r}")
    return float(softmax_scale)


def docs_arg(documents: torch.Tensor | None):
    """The DOCS kernel argument: the bounds (contiguous) or 0 (an unused pointer argument)."""
    return 0 if documents is None else documents.contiguous()


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, position, head) strides of a [B, L, H, D] tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def kernel_flags(q: torch.Tensor, causal: bool, window: int | None) -> dict:
    D = q.shape[-1]
    return dict(HEAD_DIM=D, BLOCK_D=next_pow2(D), CAUSAL=causal, HAS_WINDOW=window is not None,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


@functools.lru_cache(maxsize=None)
def tma_device(device: torch.device) -> bool:
    """Tensor descriptors work here: under the interpreter, or on an sm90+ GPU with Triton's TMA API."""
    if interpreting():
        return True
    return hasattr(tl, "make_tensor_descriptor") and torch.cuda.get_device_capability(device)[0] >= 9


def stream_flags(kernel: str, window: int | None, *streamed: torch.Tensor) -> dict:
    """USE_TMA and ONE_LOOP of ``kernel`` ("fwd", "dkdv", "dq") from the TMA and ONE_LOOP knobs; TMA
    also needs 16-bit ``streamed`` tensors ([B, L, H, D], last dim contiguous) whose base and (batch,
    position, head) strides are 16-byte aligned, the descriptor's base and row pitch, and on the GPU
    next_pow2(L) * D >= :data:`TMA_MIN_ELEMS`."""
    L, D = streamed[0].shape[1], streamed[0].shape[-1]
    use_tma = (TMA[kernel] and streamed[0].dtype != torch.float32 and tma_device(streamed[0].device)
               and (interpreting() or next_pow2(L) * D >= TMA_MIN_ELEMS)
               and all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in strides(t))
                       for t in streamed))
    if use_tma and not interpreting():
        triton.set_allocator(tma_scratch)  # per call: the allocator is per thread (autograd runs backward elsewhere)
    return dict(USE_TMA=use_tma, ONE_LOOP=ONE_LOOP[kernel]["causal" if window is None else "window"])


def group_programs(kernel: str) -> int:
    """The ``group_programs`` argument of ``kernel``'s programs (:data:`GROUP_WAVES`)."""
    waves = GROUP_WAVES[kernel]
    return 2**31 - 1 if waves is None else int(waves * num_sms())


def split_rows_block(group: int, T: int) -> int:
    """M tile of the split-KV kernel: the group's query rows, 16 (smallest tl.dot) to SPLIT_MAX_ROWS."""
    return min(max(next_pow2(group * T), 16), SPLIT_MAX_ROWS)


def auto_splits(B: int, T: int, Hq: int, Hkv: int, n_keys: int) -> int:
    """0 for the one-pass kernel, else the number of KV splits of the flash-decoding kernel."""
    if T > SPLIT_MAX_T and (triton.cdiv(T, 64) * B * Hq >= num_sms() or n_keys < 8 * T):
        return 0
    return split_count(B, T, Hq, Hkv, n_keys)


def split_count(B: int, T: int, Hq: int, Hkv: int, n_keys: int) -> int:
    """KV splits of the flash-decoding kernel over ``n_keys`` keys: enough programs for
    ``SPLIT_WAVES`` per SM, no split under ``SPLIT_MIN_KEYS`` keys, at least one."""
    base = B * Hkv * triton.cdiv(Hq // Hkv * T, split_rows_block(Hq // Hkv, T))
    return max(1, min(triton.cdiv(SPLIT_WAVES * num_sms(), base), triton.cdiv(n_keys, SPLIT_MIN_KEYS)))
