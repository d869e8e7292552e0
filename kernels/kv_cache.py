"""Write keys and values into a static KV cache at a fill position held in device memory.

For ``k, v [B, T, Hkv, D]`` and caches ``k_cache, v_cache [B, S_max, Hkv, D]``, with ``p`` the
value of the 0-d int tensor ``pos`` (read by the kernel, never by the host)::

    k_cache[b, p + t] = k[b, t],   v_cache[b, p + t] = v[b, t]      for t < T with p + t < S_max

Positions past ``S_max`` are dropped (the host cannot check a device value; the caller sizes the
cache). One program copies one ``(b, t)`` row of both tensors (all heads, the whole head dim), so
a decode step's write is one launch of ``B`` programs with no shape that depends on ``p``: it can be
captured in a CUDA graph and replayed while ``pos`` advances.
"""

from __future__ import annotations

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_same_device, check_same_dtype, check_tensor
from .launch import next_pow2
from .custom_op import compilable, compiled, define, eager, fake


@triton.jit
def _kv_cache_write_kernel(
    K, V,                          # [B, T, H, D] new keys and values, any strides, last dim contiguous
    KC, VC,                        # [B, S_max, H, D] caches, any strides, last dim contiguous
    POS,                           # 0-d int32/int64: cache row of t = 0
    T, H, S_max,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    p = tl.load(POS).to(tl.int64) + t
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rows = tl.zeros([BLOCK_H], dtype=tl.int64) + p  # the cache row, per head lane
    mask = ((h < H) & (rows < S_max))[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(K + b * stride_kb + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + b * stride_vb + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(KC + b * stride_kcb + p * stride_kcs + h[:, None] * stride_kch + d[None, :], k, mask=mask)
    tl.store(VC + b * stride_vcb + p * stride_vcs + h[:, None] * stride_vch + d[None, :], v, mask=mask)


@compilable
def kv_cache_write_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    pos: torch.Tensor) -> None:
    """In place: ``k_cache[:, p:p + T] = k`` and ``v_cache[:, p:p + T] = v`` with ``p = pos`` read on
    the device (positions ``>= S_max`` dropped).

    Args:
        k, v: ``[B, T, Hkv, D]``, any strides with a contiguous last dimension (e.g. views of a packed qkv).
        k_cache, v_cache: ``[B, S_max, Hkv, D]`` of the same dtype, last dimension contiguous.
        pos: 0-d int32/int64 tensor on the same device, the cache row of ``t = 0``.
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, ndim=4)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 0 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pos must be a 0-d int32/int64 tensor, got "
                         f"{pos.dtype if isinstance(pos, torch.Tensor) else type(pos).__name__}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, pos=pos)
    check_same_dtype(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    B, T, H, D = k.shape
    if (k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]) != (B, H, D):
        raise ValueError(f"k_cache must have shape [B, S_max, Hkv, D] = [{B}, S_max, {H}, {D}], "
                         f"got {tuple(k_cache.shape)}")
    if k.numel() == 0:
        return
    _kv_cache_write_kernel[(B * T,)](
        k, v, k_cache, v_cache, pos, T, H, k_cache.shape[1], k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=D, BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=1 if interpreting() else 4)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def kv_cache_write_op(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor) -> None:
    """:func:`kernels.kv_cache.kv_cache_write_`."""
    eager(kv_cache_write_)(k, v, k_cache, v_cache, pos)


@fake(kv_cache_write_op)
def _(k, v, k_cache, v_cache, pos):
    return None


@compiled("kv_cache_write_")
def _compiled_kv_cache_write_(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor) -> None:
    kv_cache_write_op(k, v, k_cache, v_cache, pos)
