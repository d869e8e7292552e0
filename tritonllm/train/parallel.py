"""Training on several GPUs (or CPU processes) with PyTorch's own engine, applied to the
single-device model from outside (its code knows nothing of distribution), in the manner of torchtitan's
``parallelize``.

``torchrun --nproc_per_node=N -m tritonllm.train +model=... trainer.parallel=auto|ddp|fsdp|none``:
every process runs the same loop on its own device (``cuda:<LOCAL_RANK>``; the CPU with gloo when
there is no GPU), joined in one process group (NCCL on GPUs, gloo on the CPU) from torchrun's
environment (``init_distributed``). Without torchrun (no ``WORLD_SIZE`` in the environment) there is
one process and no process group, and nothing here changes the single-device run.

Modes (:func:`resolve_parallel`, :func:`parallelize`):

- ``ddp``: ``DistributedDataParallel``: gradients all-reduced (averaged) in buckets overlapped with
  the backward, and with gradient accumulation only after the last micro-batch (``no_sync`` on the
  others). The model, its bf16 weights and the optimizer (fp32 master weights and moments) are
  replicated; every rank's AdamW makes the same update. Gradients are bucket views
  (``gradient_as_bucket_view``). The optimizer step can stay in one CUDA graph: DDP is built on a
  side stream and the step warms up for :data:`DDP_GRAPH_WARMUP` eager steps before the capture,
  as PyTorch's CUDA-graph notes ask, and the captured graph holds the NCCL all-reduces.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on each block, then on the root, which
  holds the embedding, the final norm and the LM head together: the tied embedding, which the fused
  LM-head cross-entropy reads inside the root's forward, is unsharded there. The model is built in
  fp32; the sharded fp32 parameters are the master weights, all-gathered in bf16 for compute and
  their gradients reduce-scattered in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``; fp32 throughout on the CPU). tritonllm's AdamW updates each rank's local
  shards (moments sharded alike) and the global gradient norm is reduced over the ranks
  (:func:`tritonllm.optim.clip_grad_norm_`). Gradients are reduce-scattered after every
  micro-batch (accumulating unsharded gradients instead would hold a full gradient per rank).
  MoE layers: the expert weights ``[E, ...]`` are sharded along the expert dimension like any
  other weight and all-gathered for compute: FSDP, not expert parallelism (every rank runs every
  expert on its own tokens; no all-to-all). FSDP2's all-gathers and reduce-scatters run on their
  own streams with their own allocations, which a CUDA graph capture does not take: the step is
  eager under FSDP2 (said in one log line).
- On GPUs both modes switch tritonllm's GEMM grid (:func:`gemm_grid_beside_nccl`): NCCL's kernels run
  beside ours and hold SMs, which the persistent grid's static tile shares wait for. The
  warp-specialized Hopper GEMM takes its tiles from a global counter instead, the other GEMM kernels
  run one program per output tile; ``TRITONLLM_GEMM_SM_MARGIN`` SMs can be left to NCCL (0 by default).
- ``auto``: one process -> ``none``; several -> ``ddp`` when the weights, gradients and optimizer
  state (16 bytes per parameter) fit in half of one GPU's memory (the rest for activations), else
  ``fsdp``.
- ``none``: the single-device model (one process only: several would train independent copies).

Data: each rank reads a disjoint share of every global batch of the seeded window order
(:class:`tritonllm.data.TokenLoader` with ``rank`` / ``world_size``), so ``trainer.batch_size`` is per
rank and the losses are those of one process with ``world_size`` times the batch. The saved data
position is the global one, valid for any world size.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tritonllm.errors import ConfigError
from tritonllm.runtime import resolve_device

log = logging.getLogger("tritonllm.train")

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")
#: eager DDP steps before a CUDA-graph capture: DDP rebuilds its buckets after the first iterations,
#: and PyTorch's CUDA-graph notes ask for at least 11 DDP-enabled eager iterations before capturing
DDP_GRAPH_WARMUP = 11
#: bytes per parameter that ``auto`` counts for DDP: bf16 weight and gradient, fp32 master and two moments
_DDP_BYTES_PER_PARAM = 16


@dataclass
class DistEnv:
    """This process's place in the run: ``rank`` of ``world_size``, its ``device``, and whether
    :func:`init_distributed` created the process group (and :func:`shutdown` destroys it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        """Whether a process group joins this process to others (also with ``world_size`` 1 under torchrun)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def main(self) -> bool:
        """Rank 0: the process that logs, writes the run's files and shows the progress bar."""
        return self.rank == 0


def launched() -> bool:
    """Whether this process was started by torchrun (or anything else that sets its environment)."""
    return "WORLD_SIZE" in os.environ


def init_distributed(device_spec: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Join the process group torchrun's environment describes (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); without torchrun, one process on ``device_spec``.

    The device is ``cuda:<LOCAL_RANK>`` when ``device_spec`` is ``auto`` or ``cuda`` and a GPU is
    present (backend NCCL), else the CPU (backend gloo). A collective that waits longer than
    ``timeout_s`` fails instead of hanging (torchrun also stops every rank as soon as one exits).
    A process group that already exists is used as it is.
    """
    if not launched():
        return DistEnv(device=resolve_device(device_spec))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_spec in ("auto", "cuda") and torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    elif device_spec in ("auto", "cpu"):
        device = torch.device("cpu")
    else:
        raise ConfigError(f"device={device_spec!r} under torchrun: use auto, cuda (cuda:<LOCAL_RANK> per "
                          f"process) or cpu")
    owns = False
    if not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=datetime.timedelta(seconds=float(timeout_s)),
                                             device_id=device if device.type == "cuda" else None)
        owns = True
    elif torch.distributed.get_world_size() != world:
        raise ConfigError(f"the process group has {torch.distributed.get_world_size()} ranks but WORLD_SIZE={world}")
    return DistEnv(rank, world, local_rank, device, owns)


def shutdown(env: DistEnv) -> None:
    """Destroy the process group if :func:`init_distributed` created it, once every rank is here (a
    rank that tears its connections down while another still finishes can abort the other with gloo)."""
    if env.owns_group and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def broadcast_object(obj, env: DistEnv):
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    if not env.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        torch.distributed.barrier()


def resolve_parallel(setting, env: DistEnv, n_params: int) -> str:
    """``trainer.parallel`` -> ``none``, ``ddp`` or ``fsdp`` (see the module docstring for ``auto``)."""
    setting = "auto" if setting is None else str(setting).lower()
    if setting not in PARALLEL_MODES:
        raise ConfigError(f"trainer.parallel={setting!r} is not one of {', '.join(PARALLEL_MODES)}")
    if setting in ("ddp", "fsdp") and not env.distributed:
        raise ConfigError(f"trainer.parallel={setting} needs a process group: start the run with "
                          f"torchrun --nproc_per_node=N -m tritonllm.train ...")
    if setting == "none" and env.world_size > 1:
        raise ConfigError(f"trainer.parallel=none with {env.world_size} processes would train {env.world_size} "
                          f"independent copies: use ddp, fsdp or auto")
    if setting != "auto":
        return setting
    if env.world_size == 1:
        return "none"
    if env.device.type != "cuda":
        return "ddp"
    need = _DDP_BYTES_PER_PARAM * n_params
    have = torch.cuda.get_device_properties(env.device).total_memory
    mode = "ddp" if need <= have / 2 else "fsdp"
    log.info("trainer.parallel=auto -> %s (weights, gradients and optimizer state %.1f GB, GPU %.1f GB)",
             mode, need / 1e9, have / 1e9)
    return mode


class Parallel:
    """A model made ready for a training step on ``env``'s ranks (:func:`parallelize` builds it).

    ``module`` is the single-device model (its attributes and methods, e.g. ``cfg``); ``wrapped`` is what
    the step calls (the DDP wrapper, or ``module`` itself, whose blocks FSDP2 has sharded in place).
    """

    def __init__(self, mode: str, env: DistEnv, module: torch.nn.Module, wrapped: torch.nn.Module):
        self.mode, self.env, self.module, self.wrapped = mode, env, module, wrapped

    @property
    def capturable(self) -> bool:
        """Whether the step may be captured in a CUDA graph (not with FSDP2: see the module docstring)."""
        return self.mode != "fsdp"

    @property
    def graph_warmup(self) -> int:
        """Eager steps before the capture (DDP needs more than the single-device step's two)."""
        return DDP_GRAPH_WARMUP if self.mode == "ddp" else 2

    def micro_batch(self, last: bool):
        """Context for one micro-batch's forward and backward: DDP skips the gradient all-reduce
        (``no_sync``) on all but the last micro-batch of a step."""
        if isinstance(self.wrapped, DDP) and not last:  # mode "ddp"
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` replaced in place by its mean over the ranks (a sum all-reduce, then a division:
        gloo has no average); the identity on one process."""
        if self.env.distributed and self.env.world_size > 1:
            torch.distributed.all_reduce(t)
            t.div_(self.env.world_size)
        return t

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a host-side vote: only outside the step, e.g. after
        a CUDA-graph capture, so that all ranks replay graphs or all run eagerly)."""
        if not (self.env.distributed and self.env.world_size > 1):
            return ok
        flag = torch.tensor([int(ok)], device=self.env.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())


#: TRITONLLM_GEMM_GRID: (gemm.PERSISTENT, gemm.DYNAMIC) of each grid beside NCCL, the default first
GEMM_GRIDS = {"dynamic": (False, True), "tile": (False, False), "persistent": (True, False)}


def gemm_grid_beside_nccl() -> str:
    """Pick the GEMM's grid for a GPU whose SMs NCCL's kernels share, ``TRITONLLM_GEMM_GRID``:
    ``dynamic`` (the default): gemm_sm90's warp-specialized kernel on a persistent grid whose programs
    take tiles from a global counter (``gemm.DYNAMIC``), the other GEMM kernels one program per output
    tile (``gemm.PERSISTENT = False``); ``tile``: every kernel one program per tile; ``persistent``:
    the single-GPU default, min(#SMs, tiles) programs with a static share of the tiles each.
    ``TRITONLLM_GEMM_SM_MARGIN`` (an integer >= 0, default 0) sets ``gemm.SM_MARGIN``: the SMs the
    persistent grids leave free for NCCL's kernels (timed under FSDP2 on 4 H100s: no gain shown apart from
    the machine's drift from run to run; docs/perf/NOTES.md).

    A static share waits for SMs that NCCL holds: on an H100 with 16 SMs held by another kernel for the
    whole op, void1b's four linear layers (fwd+bwd, the WS kernel) took 5.58 ms with the persistent
    grid, 3.99 ms with one program per tile and 3.86 ms with dynamic tiles (3.31 / 3.39 / 3.49 ms alone;
    cuBLAS 4.14, alone 2.90; held for the op's first half: 3.78 / 3.69 / 3.37, cuBLAS 3.29;
    docs/perf/NOTES.md, scripts/sm_contention.py). Returns the grid chosen, also said in a log line."""
    from tritonllm.kernels import gemm

    grid = os.environ.get("TRITONLLM_GEMM_GRID", "dynamic")
    if grid not in GEMM_GRIDS:
        raise ConfigError(f"TRITONLLM_GEMM_GRID must be one of {', '.join(GEMM_GRIDS)}, got {grid!r}")
    margin = os.environ.get("TRITONLLM_GEMM_SM_MARGIN", "0")
    if not margin.isdigit():
        raise ConfigError(f"TRITONLLM_GEMM_SM_MARGIN must be an integer >= 0 (SMs left to NCCL), got {margin!r}")
    gemm.PERSISTENT, gemm.DYNAMIC = GEMM_GRIDS[grid]
    gemm.SM_MARGIN = int(margin)
    log.info("GEMM grid beside NCCL (NCCL's kernels share the SMs): %s%s", {
        "dynamic": "the WS kernel's tiles from a global counter, other kernels one program per output tile",
        "tile": "one program per output tile (TRITONLLM_GEMM_GRID)",
        "persistent": "persistent, static tile shares (TRITONLLM_GEMM_GRID)"}[grid],
        f"; persistent grids leave {gemm.SM_MARGIN} SMs to NCCL (TRITONLLM_GEMM_SM_MARGIN)" if gemm.SM_MARGIN else "")
    return grid


def parallelize(model: torch.nn.Module, mode: str, env: DistEnv, *,
                compute_dtype: torch.dtype = torch.float32) -> Parallel:
    """Apply ``mode`` (``none``, ``ddp``, ``fsdp``) to ``model``, a :class:`~tritonllm.models.Transformer`
    on ``env.device``. For ``fsdp`` the model must hold fp32 weights (the sharded master weights);
    ``compute_dtype`` is the dtype FSDP2 all-gathers them in."""
    if mode == "none":
        return Parallel(mode, env, model, model)
    if mode in ("ddp", "fsdp") and env.device.type == "cuda":
        gemm_grid_beside_nccl()
    if mode == "ddp":
        if env.device.type == "cuda":
            # built on a side stream, as a DDP step captured later in a CUDA graph requires
            side = torch.cuda.Stream(env.device)
            side.wait_stream(torch.cuda.current_stream(env.device))
            with torch.cuda.stream(side):
                wrapped = DDP(model, device_ids=[env.device.index], gradient_as_bucket_view=True)
            torch.cuda.current_stream(env.device).wait_stream(side)
        else:
            wrapped = DDP(model, gradient_as_bucket_view=True)
        log.info("DDP over %d ranks (%s)", env.world_size, torch.distributed.get_backend())
        return Parallel(mode, env, model, wrapped)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bad = {str(p.dtype) for p in model.parameters() if p.dtype != torch.float32}
        if bad:
            raise ValueError(f"model: FSDP2 shards fp32 master weights; the model holds {', '.join(sorted(bad))}")
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
        blocks = model.blocks
        if not isinstance(blocks, torch.nn.ModuleList):
            raise TypeError(f"model: FSDP2 shards a Transformer's blocks (a ModuleList), got {type(blocks).__name__}")
        for i, block in enumerate(blocks):
            # the last block's weights are needed again first in the backward: keep them gathered
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
        # the root: embedding, final norm and LM head (the tied embedding is read by the LM head in
        # the root's forward, so it is one unsharded weight there), gathered through the backward
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        log.info("FSDP2 over %d ranks (%s): %d blocks + root, compute %s, gradients reduced in fp32",
                 env.world_size, torch.distributed.get_backend(), len(blocks),
                 str(compute_dtype).replace("torch.", ""))
        return Parallel(mode, env, model, model)
    raise ValueError(f"mode must be none, ddp or fsdp, got {mode!r}")
