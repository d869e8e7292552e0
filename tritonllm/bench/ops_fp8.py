"""Benchmark of the FP8 LM head: ``linear_cross_entropy(x, W, t, fp8=True)`` (op
``linear_cross_entropy_fp8``) against the same fused head in bf16 (``tritonllm bf16``), torch eager
and torch.compile of ``cross_entropy(linear(x, W).float(), t)``, and Liger-Kernel's fused linear
cross-entropy. Shapes as ``linear_cross_entropy``'s (tokens x hidden x vocab): "default" is
void125m's head, "large" a 4096-wide model with a 131072-token vocabulary. FLOPs: 2MNK forward,
4MNK backward (dx and dW), whatever the operand precision (the rows' TFLOP/s are comparable with
the bf16 head's). The forward and the dx GEMM run on fp8 operands, the dW GEMM in bf16
(``kernels.linear_cross_entropy``). Needs a GPU with fp8 tensor cores (Hopper, Ada).
"""

from __future__ import annotations

import torch

from tritonllm.bench.harness import Case, compiled, liger_available
from tritonllm.bench.ops_linear import SHAPES, gemm_flops, lce_liger, lce_torch, random_weight
from tritonllm.kernels import linear_cross_entropy

OPS = ["linear_cross_entropy_fp8"]


def _fp8_head_case(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
        return x, random_weight(vocab, hidden, dtype), torch.randint(0, vocab, (tokens,), device="cuda")

    baselines = {"tritonllm bf16": lambda x, w, t: linear_cross_entropy(x, w, t), "torch": lce_torch,
                 "torch.compile": compiled(lce_torch)}
    if liger_available():
        baselines["liger"] = lce_liger
    return Case("linear_cross_entropy_fp8", f"{tokens}x{hidden}x{vocab}", dtype, make_inputs,
                ours=lambda x, w, t: linear_cross_entropy(x, w, t, fp8=True), baselines=baselines,
                flops=gemm_flops(tokens, vocab, hidden), measure_memory=True)


def cases(size: str, dtype: torch.dtype):
    """The FP8 head at the ``linear_cross_entropy`` shapes of ``size`` ("default" or "large")."""
    if size not in SHAPES:
        raise ValueError(f"size must be one of {sorted(SHAPES)}, got {size!r}")
    for shape in SHAPES[size]["linear_cross_entropy"]:
        yield _fp8_head_case(*shape, dtype)
