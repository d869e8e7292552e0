"""What the kernels' configs are planned against on the current CUDA device: its streaming
multiprocessors, its shared memory per program, whether it is a Hopper GPU, and a side stream for work
that runs beside the current stream's. Fixed stand-ins under the interpreter.
"""

from __future__ import annotations

import functools
import logging

import torch

from ._interpreter import interpreting

_log = logging.getLogger("tritonllm.kernels")


@functools.lru_cache(maxsize=None)
def hopper(device: torch.device) -> bool:
    """Whether ``device`` (a CUDA ``torch.device`` with its index) is a Hopper GPU (sm_90: H100, H200)."""
    return torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One more CUDA stream of ``device`` (a ``torch.device`` with its index) for work that runs beside the
    current stream's (a backward's dW product beside its dx product). The caller forks it from the
    current stream (``wait_stream``) and joins it back before it returns, so tensors that the current stream
    allocated and frees afterwards stay valid while the side stream works on them; a CUDA graph capture
    then records the two as parallel branches."""
    return torch.cuda.Stream(device=device)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    """Number of streaming multiprocessors of the current CUDA device (4 under the interpreter)."""
    if interpreting() or not torch.cuda.is_available():
        return 4
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


def smem_per_block() -> int:
    """Bytes of shared memory one program may use on the current CUDA device: its opt-in maximum per
    block (227 KiB on an H100 or H200, 163 KiB on an A100, 99 KiB on most consumer GPUs).
    ``SMEM_PER_BLOCK`` under the interpreter, and, said in a log line, where torch does not report it."""
    if interpreting() or not torch.cuda.is_available():
        return SMEM_PER_BLOCK
    return _device_smem(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_smem(idx: int) -> int:
    size = getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", None)
    if not size:
        _log.info("torch does not report device %d's shared memory per block: configs are planned for %d KiB",
                  idx, SMEM_PER_BLOCK // 1024)
        return SMEM_PER_BLOCK
    return int(size)


def smem_budget(reserve: int) -> int:
    """The shared memory every kernel's config pruning plans against: :func:`smem_per_block` of the
    current device less ``reserve`` bytes, what the kernel's own estimate leaves out (layout
    conversions, barriers, staging)."""
    return smem_per_block() - reserve


#: shared memory one program may use on sm90 (H100/H200: 227 KiB per block, opt-in): what
#: :func:`smem_per_block` assumes under the interpreter or where the device does not report it
SMEM_PER_BLOCK = 227 * 1024
