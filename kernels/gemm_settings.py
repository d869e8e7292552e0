"""The user's choices for the GEMM engine (:mod:`kernels.gemm`, the kernels built on its grid, linear's backward):
:class:`GemmSettings`, the settings in force (:func:`gemm_settings`) and the one way to change them
(:func:`configure_gemm`)::

    from tritonllm.kernels import configure_gemm

    configure_gemm(persistent=False, dynamic=True)   # from now on
    with configure_gemm(sm_margin=8):                # for a block; the settings before come back after it
        ...

The settings are part of every GEMM launch plan's key, so a change takes effect at the next GEMM (a
problem planned under other settings is planned again). ``tritonllm.train`` sets the grid beside NCCL
from the config (``trainer.gemm_grid``, ``trainer.gemm_sm_margin``). Measured tuning facts that no run
should change (block sizes, the shared-memory reserve, the split-K thresholds) stay constants of the
kernel modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .settings import Settings, configure, in_force


@dataclass(frozen=True)
class GemmSettings(Settings):
    """The GEMM engine's switches, with the measured defaults (docs/perf/history.md; scripts/tune_linear.py
    and scripts/sm_contention.py time them on the GPU). Used as a context manager (``with
    configure_gemm(...)``, which returns the settings before the change), an instance puts itself back in
    force when the block ends (:mod:`kernels.settings`)."""

    #: flatten the persistent tile loop into the K loop (``tl.range(flatten=...)``): the pipeliner then loads
    #: the next tile's first K blocks during this tile's last ones and its epilogue. On with ``tma_store``:
    #: measured on an H200 (scripts/tune_linear.py, stage A) the pair was the best or within 2% of the best
    #: knob set for every forward and dx GEMM at the void125m shapes, e.g. 16384x768x32000 forward 1.07x
    #: cuBLAS against 0.97x with both off.
    flatten: bool = True
    #: warp-specialize the persistent loop (``tl.range(warp_specialize=...)``, TMA operands only): a producer
    #: warp issues the TMA loads while the MMA warps compute and store. Overrides ``flatten``; its configs run
    #: 4 warps (``gemm._config``). Off: not faster than ``flatten`` in the same stage-A timings.
    warp_specialize: bool = False
    #: write C (and the SwiGLU gate/up pre-activations) through tensor descriptors (asynchronous TMA stores)
    #: where the outputs allow it, instead of masked pointer stores from registers (see ``flatten``).
    tma_store: bool = True
    #: with ``tma_store``, store each tile as two [BLOCK_M, BLOCK_N / 2] halves (half the staging memory);
    #: off: no gain in stage A.
    epilogue_subtile: bool = False
    #: launch min(#SMs, tiles) programs that each take tiles p, p + P, ... (True: ``flatten`` overlaps a
    #: tile's epilogue with the next tile's first loads), or one program per tile (False: the hardware hands
    #: tiles to SMs as they free up, so SMs held by another stream's kernels, NCCL's under FSDP2, delay only
    #: the tiles queued behind them instead of a whole program's share). scripts/sm_contention.py times both
    #: beside cuBLAS with some SMs held; ``trainer.gemm_grid`` picks it for DDP and FSDP2 on GPUs.
    persistent: bool = True
    #: on Hopper, run the plain and residual products of 16-bit tensor-descriptor operands through
    #: gemm_sm90's warp-specialized Gluon kernel (a producer warp streaming the tiles, two consumer
    #: warpgroups, cooperative or ping-pong) instead of ``_matmul_kernel``. On: each GEMM of linear (fwd, dx,
    #: dW) at the nine benchmark shapes, alone in CUDA graphs, ran 1.00-1.09x ``_matmul_kernel`` (the best of
    #: both through their autotuners; 0.998x at 8192^3's dW), 0.82-1.06x cuBLAS (scripts/tune_linear.py
    #: splits, H100).
    sm90_ws: bool = True
    #: linear_swiglu's fused forward (SWIGLU_FWD) through gemm_sm90's kernel too (two accumulators, gate and
    #: up, and a B ring twice as deep; its GATED_CONFIGS). On: at 16384x768x(2x2048) on an H100, in CUDA
    #: graphs, the forward ran 0.168 and 0.171 ms in two runs against ``_matmul_kernel``'s 0.214 and 0.215
    #: (1.28x cuBLAS + Triton swiglu; scripts/tune_linear.py swiglu).
    sm90_ws_gated: bool = True
    #: gemm_sm90's kernel on a persistent grid (min(#SMs, tiles) programs, whatever ``persistent`` says,
    #: which then sets the other kernels' grid) whose programs take their tiles from a global counter as they
    #: get to them (``scratch.tile_counter``) instead of every P-th tile: a program that starts late, behind
    #: another stream's kernels on its SM (NCCL's under FSDP2), takes fewer tiles instead of holding back a
    #: share, and each program still overlaps a tile's epilogue with the next tile's loads. Each tile is one
    #: program's whole K loop either way: the same bits. ``trainer.gemm_grid`` sets it for DDP and FSDP2 on
    #: GPUs; ``gemm(dynamic=...)`` sets it for one call (linear's backward, for dW and dx run side by side).
    dynamic: bool = False
    #: SMs that the persistent grids leave to another stream's kernels: min(#SMs - sm_margin, tiles)
    #: programs (at least one). cuBLAS's ``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`` and Transformer Engine's
    #: SM margin do the same, so that NCCL's kernels, launched while a GEMM runs, find free SMs instead of
    #: waiting for the GEMM to end. 0 (none) by default; ``trainer.gemm_sm_margin`` sets it beside NCCL.
    #: Timed under FSDP2 on 4 H100s (2026-11-27): no gain shown apart from the machine's drift from run to run.
    sm_margin: int = 0
    #: on Hopper, linear's backward runs dW = dy^T x on a second CUDA stream beside dx = dy W when dW's [N, K]
    #: output has fewer than two waves of 128x256 tiles: each is a long K loop over the tokens, and the SMs
    #: that a short last wave leaves idle take dx's tiles, which both products then hand out from a global
    #: counter (``dynamic``; a program that starts late takes fewer tiles). The results are the same bits
    #: either way. Measured on an H100 in two runs (scripts/tune_linear.py overlap): the backward at
    #: 16384x768x4096 ran 0.88 / 0.91 -> 0.92 / 0.96x cuBLAS, linear_swiglu's 0.96 / 0.91 -> 1.02 / 0.96x;
    #: 16384x768x2304 lost 2% / 5% (not understood), and with more dW tiles (8192x2048x11264, 8192^3) it cost
    #: 1-2%, hence the threshold. void125m's step: 1.052x -> 1.079x (with the gated WS forward). Off: one
    #: after the other.
    overlap_dw: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in (bool, "bool") and not isinstance(value, bool):
                raise TypeError(f"GemmSettings.{field.name} must be a bool, got {value!r}")
        if isinstance(self.sm_margin, bool) or not isinstance(self.sm_margin, int) or self.sm_margin < 0:
            raise ValueError(f"GemmSettings.sm_margin must be an integer >= 0 (SMs left free), got {self.sm_margin!r}")
        # hashed once: the settings are part of every GEMM launch plan's key (1.1 us a lookup hashed each time)
        self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def __hash__(self) -> int:
        return self.__dict__["_hash"]


def gemm_settings() -> GemmSettings:
    """The GEMM settings in force."""
    return in_force(GemmSettings)


def configure_gemm(settings: GemmSettings | None = None, /, **fields) -> GemmSettings:
    """Put ``settings`` (default: the settings in force) with ``fields`` replaced in force for every GEMM
    from now on; return the settings before the change. An unknown field or a wrong value is refused by
    name. ``with configure_gemm(...):`` restores the settings before it when the block ends."""
    return configure(GemmSettings, settings, fields, "configure_gemm")
