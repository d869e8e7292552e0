"""The host side of flash attention's launches, shared by the forward and backward launchers: strides, the
documents argument, the kernels' shape and precision flags, and the TMA and loop flags the settings and the
inputs allow."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._interpreter import interpreting
from ..launch import next_pow2
from ..scratch import tma_scratch
from .settings import attention_settings
from .tuning import TMA_MIN_ELEMS


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
    """USE_TMA and ONE_LOOP of ``kernel`` ("fwd", "dkdv", "dq") from the settings' ``tma`` and ``one_loop``; TMA
    also needs 16-bit ``streamed`` tensors ([B, L, H, D], last dim contiguous) whose base and (batch,
    position, head) strides are 16-byte aligned, the descriptor's base and row pitch, and on the GPU
    next_pow2(L) * D >= :data:`TMA_MIN_ELEMS`."""
    L, D = streamed[0].shape[1], streamed[0].shape[-1]
    settings = attention_settings()
    use_tma = (settings.tma[kernel] and streamed[0].dtype != torch.float32 and tma_device(streamed[0].device)
               and (interpreting() or next_pow2(L) * D >= TMA_MIN_ELEMS)
               and all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in strides(t))
                       for t in streamed))
    if use_tma and not interpreting():
        triton.set_allocator(tma_scratch)  # per call: the allocator is per thread (autograd runs backward elsewhere)
    return dict(USE_TMA=use_tma, ONE_LOOP=settings.one_loop[kernel]["causal" if window is None else "window"])
