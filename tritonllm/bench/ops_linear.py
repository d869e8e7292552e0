"""Benchmarks of the GEMM family: ``linear``, ``linear_swiglu`` and the fused LM-head
``linear_cross_entropy``, against cuBLAS (``F.linear``), torch eager, torch.compile and Liger-Kernel.

Shapes: ``MxKxN`` for the GEMMs (``linear_swiglu``: N = 2F, the gate and up columns),
tokens x hidden x vocab for ``linear_cross_entropy``. All three are compute-bound: FLOPs are
2MNK forward and 4MNK backward (dx and dW). ``linear_cross_entropy`` also records the peak memory
of fwd+bwd for ours and each baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.bench import reference_ops as ref
from tritonllm.bench.harness import Case, compiled, liger_available, with_host
from tritonllm.kernels import linear, linear_cross_entropy, linear_swiglu

OPS = ["linear", "linear_swiglu", "linear_cross_entropy"]

SHAPES = {
    "default": {
        "linear": [(16384, 768, 2304), (16384, 768, 4096), (16384, 2048, 768), (16384, 768, 32000)],
        "linear_swiglu": [(16384, 768, 2048)],  # (M, K, F)
        "linear_cross_entropy": [(16384, 768, 32000)],  # (tokens, hidden, vocab)
    },
    "large": {
        "linear": [(8192, 2048, 3072), (8192, 2048, 11264), (8192, 5632, 2048), (8192, 8192, 8192)],
        "linear_swiglu": [(8192, 2048, 5632)],
        "linear_cross_entropy": [(8192, 4096, 131072)],
    },
}


#: small problems at which the host time of one call is measured (size "default", first case of each op)
HOST_SHAPES = {"linear": (8, 768, 768), "linear_swiglu": (8, 768, 2048), "linear_cross_entropy": (8, 768, 32000)}
#: the PyTorch op each is compared with on the host
HOST_BASELINES = {"linear": "cuBLAS", "linear_swiglu": "torch", "linear_cross_entropy": "torch"}


def gemm_flops(m: int, n: int, k: int) -> dict[str, float]:
    return {"fwd": 2.0 * m * n * k, "bwd": 4.0 * m * n * k, "fwd+bwd": 6.0 * m * n * k}


def random_weight(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(rows, k, device="cuda") * k ** -0.5).to(dtype).requires_grad_()


def _linear_case(m: int, k: int, n: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        return torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True), random_weight(n, k, dtype)

    # torch eager is F.linear, i.e. the cuBLAS baseline itself
    baselines = {"cuBLAS": F.linear, "torch.compile": compiled(F.linear)}
    return Case("linear", f"{m}x{k}x{n}", dtype, make_inputs, ours=linear, baselines=baselines,
                flops=gemm_flops(m, n, k), reference=ref.linear)


def _swiglu_cublas_triton(x, w13):
    from tritonllm.kernels import swiglu

    return swiglu(F.linear(x, w13))


def _swiglu_liger(x, w13):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return LigerSiLUMulFunction.apply(gate, up)


def _linear_swiglu_case(m: int, k: int, f: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        return torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True), random_weight(2 * f, k, dtype)

    baselines = {"cuBLAS+swiglu": _swiglu_cublas_triton, "torch": ref.linear_swiglu,
                 "torch.compile": compiled(ref.linear_swiglu)}
    if liger_available():
        baselines["liger"] = _swiglu_liger
    return Case("linear_swiglu", f"{m}x{k}x{2 * f}", dtype, make_inputs, ours=linear_swiglu, baselines=baselines,
                flops=gemm_flops(m, 2 * f, k), reference=ref.linear_swiglu)


def lce_torch(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def lce_liger(x, w, t):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()(w, x, t)


def _linear_cross_entropy_case(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
        return x, random_weight(vocab, hidden, dtype), torch.randint(0, vocab, (tokens,), device="cuda")

    baselines = {"torch": lce_torch, "torch.compile": compiled(lce_torch)}
    if liger_available():
        baselines["liger"] = lce_liger
    return Case("linear_cross_entropy", f"{tokens}x{hidden}x{vocab}", dtype, make_inputs,
                ours=lambda x, w, t: linear_cross_entropy(x, w, t), baselines=baselines,
                flops=gemm_flops(tokens, vocab, hidden), measure_memory=True,
                reference=ref.linear_cross_entropy)


def cases(size: str, dtype: torch.dtype):
    """The linear, linear_swiglu and linear_cross_entropy cases of ``size`` ("default" or "large")."""
    if size not in SHAPES:
        raise ValueError(f"size must be one of {sorted(SHAPES)}, got {size!r}")
    for op, make in (("linear", _linear_case), ("linear_swiglu", _linear_swiglu_case),
                     ("linear_cross_entropy", _linear_cross_entropy_case)):
        for i, shape in enumerate(SHAPES[size][op]):
            case = make(*shape, dtype)
            if size == "default" and i == 0:
                with_host(case, make(*HOST_SHAPES[op], dtype), HOST_BASELINES[op])
            yield case
