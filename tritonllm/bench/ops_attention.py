"""Benchmarks of fused attention: ``flash_attention`` (causal prefill/training), the sliding window
``flash_attention_window`` and KV-cache decode ``flash_attention_decode``.

Shapes read ``B16 Hq12/Hkv12 T1024 D64`` (``S`` added when it differs from T). Inputs are allocated
in ``[B, H, T, D]`` and handed to every implementation as ``[B, T, H, D]`` transposed views, so the
SDPA baseline gets its native layout without a timed transpose and ours reads the strided views.
Baselines: ``sdpa`` (``F.scaled_dot_product_attention`` with ``enable_gqa``; the backend PyTorch
picked, FlashAttention-2 or cuDNN or another, is named from its kernels in ``baselines_backend``), and where the score matrix is small enough to materialize, ``torch`` (explicit
softmax in the same dtype) and its ``torch.compile``. Liger-Kernel has no attention op and
Triton's tutorial kernel is not importable as a module, so neither is a baseline here.
The window case is compared with full causal attention at the same shape (ours and SDPA).
``flash_attention_fused`` times the fused backward with atomic dQ (``deterministic=False``) at the
causal shapes; ``flash_attention``'s ms over its ms is the cost of determinism.

FLOPs: ``4 * B * Hq * D * pairs`` forward with pairs = T * S (halved for causal; the exact count of
visible pairs with a window), backward 2.5x forward. Decode (forward only) is memory-bound: GB/s
over the KV cache read once plus q read and o written (the runner adds the fraction of copy
bandwidth).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.bench.harness import Case, compiled, with_host
from tritonllm.kernels import flash_attention

OPS = ["flash_attention", "flash_attention_fused", "flash_attention_window", "flash_attention_decode"]

# (B, Hq, Hkv, T, D), all causal with S = T
SHAPES = {
    "default": [(16, 12, 12, 1024, 64), (4, 16, 4, 2048, 128)],
    "large": [(8, 32, 8, 4096, 128), (1, 32, 8, 16384, 128)],
}
WINDOW = {"large": [(1, 32, 8, 16384, 128, 1024)]}   # (B, Hq, Hkv, T, D, window)
DECODE = {"default": [(32, 32, 8, 1, 4096, 128)]}    # (B, Hq, Hkv, T, S, D)
#: (B, Hq, Hkv, T, D) at which the host time of one call is measured against SDPA (size "default"):
#: T 32, since T <= 16 takes the split-KV decode kernels
HOST_SHAPE = (1, 12, 12, 32, 64)
#: the explicit-softmax baselines materialize B*Hq*T*S scores (fp32 softmax): only up to this many
EAGER_MAX_SCORES = 1 << 29


def _shape(B, Hq, Hkv, T, S, D, window=None) -> str:
    s = f"B{B} Hq{Hq}/Hkv{Hkv} T{T}" + (f" S{S}" if S != T else "") + f" D{D}"
    return s + (f" W{window}" if window else "")


def _visible_pairs(T: int, S: int, causal: bool, window: int | None) -> float:
    """(query, key) pairs computed: T*S, halved for causal T == S (the usual convention); the exact
    count with a window."""
    if window is None:
        return T * S / (2 if causal else 1)
    return float(sum(min(i + S - T + 1, window) for i in range(T) if i + S - T >= 0))


def attention_flops(B, Hq, T, S, D, causal, window=None) -> dict[str, float]:
    fwd = 4.0 * B * Hq * D * _visible_pairs(T, S, causal, window)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}


def _make_inputs(B, Hq, Hkv, T, S, D, dtype):
    def make():
        q = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype).transpose(1, 2)
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype).transpose(1, 2)
        return tuple(t.requires_grad_() for t in (q, k, v))
    return make


def _sdpa(causal: bool):
    """SDPA on the [B, H, T, D] storage. ``is_causal`` is top-left aligned, which equals our
    bottom-right mask for T == S; for one-token decode (T = 1) bottom-right causal sees every key."""
    def attn(q, k, v):
        is_causal = causal and q.shape[1] > 1
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return attn


#: substrings of SDPA's kernel names -> the backend they belong to, first match wins
SDPA_KERNELS = (("cudnn", "cuDNN"), ("flash", "FlashAttention-2"), ("fmha", "memory-efficient"),
                ("efficient", "memory-efficient"))


def sdpa_backend(kernels: list[str]) -> str:
    """Which of SDPA's backends ran, from the names of the GPU kernels of one call ("math": none of
    the fused ones, the explicit matmul-softmax-matmul path)."""
    names = " ".join(kernels).lower()
    return next((backend for part, backend in SDPA_KERNELS if part in names), "math")


def _torch_attention(q, k, v):
    """Explicit bottom-right causal softmax attention in the inputs' dtype (softmax in fp32)."""
    T, Hq, D = q.shape[1:]
    S, Hkv = k.shape[1], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    scores = (qt @ kt.transpose(-1, -2)) * D ** -0.5
    i = torch.arange(T, device=q.device)[:, None] + (S - T)
    j = torch.arange(S, device=q.device)[None, :]
    scores = scores.masked_fill(j > i, float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (p @ vt).transpose(1, 2)


def _baselines(B, Hq, T, S) -> dict:
    base = {"sdpa": _sdpa(True)}
    if B * Hq * T * S <= EAGER_MAX_SCORES:
        base["torch"] = _torch_attention
        base["torch.compile"] = compiled(_torch_attention)
    return base


def _causal_case(B: int, Hq: int, Hkv: int, T: int, D: int, dtype: torch.dtype) -> Case:
    return Case("flash_attention", _shape(B, Hq, Hkv, T, T, D), dtype, _make_inputs(B, Hq, Hkv, T, T, D, dtype),
                ours=flash_attention, baselines=_baselines(B, Hq, T, T), flops=attention_flops(B, Hq, T, T, D, True),
                backends={"sdpa": sdpa_backend})


def _fused(q, k, v):
    return flash_attention(q, k, v, causal=True, deterministic=False)


def cases(size: str, dtype: torch.dtype):
    for i, shape in enumerate(SHAPES.get(size, [])):
        case = _causal_case(*shape, dtype)
        if size == "default" and i == 0:
            with_host(case, _causal_case(*HOST_SHAPE, dtype), "sdpa")
        yield case
        # the fused backward (dQ by atomics, not reproducible) against the default reproducible one
        B, Hq, Hkv, T, D = shape
        yield Case("flash_attention_fused", _shape(B, Hq, Hkv, T, T, D), dtype,
                   _make_inputs(B, Hq, Hkv, T, T, D, dtype), ours=_fused, baselines={"sdpa": _sdpa(True)},
                   flops=attention_flops(B, Hq, T, T, D, True), passes=("bwd", "fwd+bwd"), backends={"sdpa": sdpa_backend})

    for B, Hq, Hkv, T, D, W in WINDOW.get(size, []):
        def windowed(q, k, v, W=W):
            return flash_attention(q, k, v, causal=True, window=W)
        yield Case("flash_attention_window", _shape(B, Hq, Hkv, T, T, D, W), dtype,
                   _make_inputs(B, Hq, Hkv, T, T, D, dtype), ours=windowed,
                   baselines={"ours full causal": flash_attention, "sdpa full causal": _sdpa(True)},
                   flops=attention_flops(B, Hq, T, T, D, True, W), backends={"sdpa full causal": sdpa_backend})

    for B, Hq, Hkv, T, S, D in DECODE.get(size, []):
        nbytes = (2 * B * S * Hkv * D + 2 * B * T * Hq * D) * torch.finfo(dtype).bits // 8
        yield Case("flash_attention_decode", _shape(B, Hq, Hkv, T, S, D), dtype,
                   _make_inputs(B, Hq, Hkv, T, S, D, dtype), ours=flash_attention,
                   baselines=_baselines(B, Hq, T, S), bytes={"fwd": nbytes}, passes=("fwd",),
                   backends={"sdpa": sdpa_backend})
