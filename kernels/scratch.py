"""Device scratch the persistent (Hopper) kernels keep for the process's life, one per (device,
stream): the global memory their TMA tensor descriptors are built in (:func:`tma_scratch`) and the work
counters of a dynamic tile schedule (:func:`tile_counter`). Never freed: a kernel captured in a CUDA
graph keeps the addresses.
"""

from __future__ import annotations

import torch

from .launch import triton_runtime

#: tensor-descriptor scratch per (device, stream), see :func:`tma_scratch`
_TMA_SCRATCH: dict[tuple, torch.Tensor] = {}

#: the buffers a grown scratch replaced: never freed (see :func:`tma_scratch`)
_TMA_SCRATCH_OUTGROWN: list[torch.Tensor] = []


def tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the tensor descriptors kernels build (``triton.set_allocator``): one
    buffer per (device, stream), grown on demand. Kernels on one stream run in order, so one buffer
    serves them all: no allocation per launch. A buffer a larger one replaces stays allocated: a
    kernel captured in a CUDA graph keeps its address and writes its descriptors there at every
    replay, so freeing it would let the graph write into whatever tensor takes the memory next."""
    key = (torch.cuda.current_device(), stream)
    buf = _TMA_SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        if buf is not None:
            _TMA_SCRATCH_OUTGROWN.append(buf)
        buf = _TMA_SCRATCH[key] = torch.empty(max(size, 1 << 16), device="cuda", dtype=torch.int8)
    return buf


#: work counters per (device, stream), see :func:`tile_counter`
_TILE_COUNTERS: dict[tuple, torch.Tensor] = {}

#: zeroed counters per device not yet handed out, allocated outside any CUDA graph capture
_TILE_COUNTER_POOLS: dict[int, list[torch.Tensor]] = {}

#: counters allocated at once: a pool serves that many streams
TILE_COUNTER_POOL = 64


def tile_counter() -> torch.Tensor:
    """Two int32 zeros on the current CUDA device for a kernel whose programs take their work from a
    global counter (gemm_sm90's dynamic schedule): the kernel leaves them at zero when it ends. One
    pair per (device, stream): kernels on one stream run in order, so they share it, while kernels on
    two streams could run at once. Kept for the process's life, as :func:`tma_scratch`'s buffers are:
    a kernel captured in a CUDA graph keeps the address (graphs captured on one stream share its pair,
    so they must not be replayed at the same time on two streams).

    The pairs come from a pool zeroed outside any capture: a stream first seen during a CUDA graph
    capture gets one that is zero already, not a zero-fill the graph would only run at its first
    replay. The first pool of a device cannot be made during a capture (a RuntimeError says so): run
    the kernel once before capturing, as a graph's warm-up does."""
    get_device, get_stream, _ = triton_runtime()
    device = get_device()
    key = (device, get_stream(device))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        pool = _TILE_COUNTER_POOLS.get(device)
        if not pool:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("tile_counter: no zeroed work counter is left on this device during a CUDA "
                                   "graph capture; launch the kernel once before capturing")
            pool = _TILE_COUNTER_POOLS[device] = list(
                torch.zeros(TILE_COUNTER_POOL, 2, device=f"cuda:{device}", dtype=torch.int32).unbind(0))
            torch.cuda.synchronize(device)  # zero before another stream's kernel takes one
        counter = _TILE_COUNTERS[key] = pool.pop()
    return counter
