"""Benchmarks of ``rms_norm``, ``swiglu`` and ``gelu_tanh`` against torch eager, torch.compile and
Liger-Kernel (plus ``F.rms_norm`` for RMSNorm, ``F.gelu`` for GELU).

Sizes: "default" = void125m shapes (rms_norm 16384x768, swiglu gate and up each 16384x2048, gelu_tanh
16384x3072, a GPT-2 small MLP); "large" = rms_norm 32768x4096, swiglu 32768x4096, gelu_tanh 32768x16384.
All are memory-bound: bytes count each input read once and each output written once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tritonllm.bench import reference_ops as ref
from tritonllm.bench.harness import Case, compiled, liger_available, with_host
from tritonllm.kernels import gelu_tanh, rms_norm, swiglu

OPS = ["rms_norm", "swiglu", "gelu_tanh"]

#: [rows, hidden] per size: rms_norm normalizes [rows, N]; swiglu's gate and up are each [rows, F];
#: gelu_tanh's input is [rows, F].
SHAPES = {
    "default": {"rms_norm": (16384, 768), "swiglu": (16384, 2048), "gelu_tanh": (16384, 3072)},
    "large": {"rms_norm": (32768, 4096), "swiglu": (32768, 4096), "gelu_tanh": (32768, 16384)},
}
EPS = 1e-6
#: small shapes at which the host time of one call is measured (size "default" only)
HOST_SHAPES = {"rms_norm": (8, 768), "swiglu": (8, 2048), "gelu_tanh": (8, 3072)}


def _rms_norm_torch(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w).to(x.dtype)


def _rms_norm_liger(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # offset 0, casting mode "llama"; in_place=False because the harness reuses one dy across
    # repetitions and Liger's in-place backward would overwrite it with dx.
    return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def _swiglu_liger(gate, up):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


def _rms_norm_case(m: int, n: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
        w = (1.0 + 0.1 * torch.randn(n, device="cuda")).to(dtype).requires_grad_()
        return x, w

    baselines = {
        "torch": _rms_norm_torch,
        "F.rms_norm": lambda x, w: F.rms_norm(x, (n,), w, EPS),
        "torch.compile": compiled(_rms_norm_torch),
    }
    if liger_available():
        baselines["liger"] = _rms_norm_liger
    es = torch.finfo(dtype).bits // 8
    fwd = (2 * m * n + n) * es                             # read x, w; write y
    bwd = (3 * m * n + 2 * n) * es + 4 * m                 # read x, dy, w, rstd (fp32); write dx, dw
    return Case("rms_norm", f"{m}x{n}", dtype, make_inputs, ours=lambda x, w: rms_norm(x, w, EPS),
                baselines=baselines, bytes={"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd},
                reference=lambda x, w: ref.rms_norm(x, w, EPS))


def _swiglu_case(m: int, f: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        gate = torch.randn(m, f, device="cuda", dtype=dtype, requires_grad=True)
        up = torch.randn(m, f, device="cuda", dtype=dtype, requires_grad=True)
        return gate, up

    baselines: dict[str, Callable] = {"torch": ref.swiglu, "torch.compile": compiled(ref.swiglu)}
    if liger_available():
        baselines["liger"] = _swiglu_liger
    es = torch.finfo(dtype).bits // 8
    fwd = 3 * m * f * es                                   # read gate, up; write y
    bwd = 5 * m * f * es                                   # read gate, up, dy; write dgate, dup
    return Case("swiglu", f"{m}x{f}", dtype, make_inputs, ours=swiglu,
                baselines=baselines, bytes={"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}, reference=ref.swiglu)


def _gelu_tanh_case(m: int, f: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        return (torch.randn(m, f, device="cuda", dtype=dtype, requires_grad=True),)

    baselines: dict[str, Callable] = {"F.gelu": ref.gelu_tanh, "torch.compile": compiled(ref.gelu_tanh)}
    es = torch.finfo(dtype).bits // 8
    fwd = 2 * m * f * es                                   # read x; write y
    bwd = 3 * m * f * es                                   # read x, dy; write dx
    return Case("gelu_tanh", f"{m}x{f}", dtype, make_inputs, ours=gelu_tanh,
                baselines=baselines, bytes={"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}, reference=ref.gelu_tanh)


def cases(size: str, dtype: torch.dtype):
    """The rms_norm, swiglu and gelu_tanh cases of ``size`` ("default" or "large") in ``dtype``."""
    if size not in SHAPES:
        raise ValueError(f"size must be one of {sorted(SHAPES)}, got {size!r}")
    rms, swi = _rms_norm_case(*SHAPES[size]["rms_norm"], dtype), _swiglu_case(*SHAPES[size]["swiglu"], dtype)
    gelu = _gelu_tanh_case(*SHAPES[size]["gelu_tanh"], dtype)
    if size == "default":
        with_host(rms, _rms_norm_case(*HOST_SHAPES["rms_norm"], dtype), "F.rms_norm")
        with_host(swi, _swiglu_case(*HOST_SHAPES["swiglu"], dtype), "torch")
        with_host(gelu, _gelu_tanh_case(*HOST_SHAPES["gelu_tanh"], dtype), "F.gelu")
    yield rms
    yield swi
    yield gelu
