"""Flash attention's input checks, shared by the forward and backward launchers: q, k, v and the options,
and the packed sequences' document bounds (errors name the argument)."""

from __future__ import annotations

import math

import torch

from ..checks import check_dot_dtype, check_same_device, check_same_dtype, check_tensor
from .tuning import HEAD_DIMS


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
