"""Flash attention's measured tuning facts: the head dims, the split-KV (decode) thresholds, the tile
configs the autotuner tries and its pruning, the program-order and split counts derived from them. The
switches a user may choose are :mod:`.settings`; the input checks :mod:`.checks`; the launch arguments
:mod:`.kernel_args`."""

from __future__ import annotations

import triton
import triton.language as tl

from .._interpreter import interpreting
from ..device import num_sms, smem_budget
from ..launch import autotune, next_pow2
from .settings import attention_settings

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

#: TMA (:class:`settings.AttentionSettings`'s ``tma``) only where the streamed tensor's length (rounded up
#: to a power of two) times the head dim reaches this on the GPU: below it a program's loop is short and
#: narrow, and building its descriptors costs more than TMA saves. H100, scripts/tune_attention.py, causal, pointer loads against TMA:
#: B16 Hq12 T1024 D64 (void125m's attention) 1.12x in the forward and the dK/dV kernel, 1.00x in dQ
#: (1.13x forward on an H200 too); B4 Hq12 T4096 D64 0.96x / 0.96x / 0.95x; B16 Hq12 T1024 D128
#: 0.98x / 1.00x / 0.97x. Under the interpreter TMA is used wherever allowed (tests' small shapes).
TMA_MIN_ELEMS = 1 << 17
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

def group_programs(kernel: str) -> int:
    """The ``group_programs`` argument of ``kernel``'s programs (``AttentionSettings.group_waves``)."""
    waves = attention_settings().group_waves[kernel]
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
