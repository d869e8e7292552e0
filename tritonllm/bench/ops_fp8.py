"""Benchmarks of the FP8 ops.

``fp8_gemm``: the GEMM alone on operands quantized per row (e4m3), scales in the epilogue, bf16 out
(``kernels.gemm.gemm`` with ``a_scale``/``b_scale``) against ``torch._scaled_mm`` with the same rowwise
scales (cuBLAS's fp8 GEMM, what torchao's rowwise recipe calls), the same with ``use_fast_accum=True``
(the tensor cores' own limited-precision sums, never promoted to fp32: what torchao uses for the forward
product; ours always promotes, so this is the faster but less exact bound) and the bf16 GEMM of the same
shape (``F.linear``). Shapes: each linear layer's three products (forward MxKxN, dx MxNxK, dW NxMxK) at
void125m's ("default") and void1b's ("large") layers.

``fp8_linear``: the whole FP8 layer (``kernels.fp8_linear.fp8_linear``: the quantizations and the
three GEMMs) against torchao float8's rowwise ``Float8Linear`` under torch.compile (when torchao is
importable), our bf16 ``linear`` and cuBLAS bf16 (``F.linear``). FLOPs 2MNK forward, 4MNK backward.

``linear_cross_entropy_fp8``: the FP8 LM head: ``linear_cross_entropy(x, W, t, fp8=True)`` (op
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

import torch.nn.functional as F

from tritonllm.bench.harness import Case, compiled, liger_available
from tritonllm.bench.ops_linear import SHAPES, gemm_flops, lce_liger, lce_torch, random_weight
from tritonllm.kernels import linear, linear_cross_entropy
from tritonllm.kernels.fp8 import quantize
from tritonllm.kernels.fp8_linear import fp8_linear
from tritonllm.kernels.gemm import gemm

OPS = ["fp8_quantize", "fp8_gemm", "fp8_linear", "linear_cross_entropy_fp8"]
E4M3 = torch.float8_e4m3fn


def _rows_and_columns_torch(x: torch.Tensor):
    """x [R, C] quantized to e4m3 per row and per column (its transpose's rows, contiguous) in PyTorch, the
    casts torchao's rowwise recipe makes of an operand both GEMMs of a layer read."""
    out = []
    for t in (x, x.t()):
        amax = t.abs().amax(dim=1, keepdim=True).float()
        scale = torch.where(amax > 0, amax / 448.0, 1.0)
        out += [(t.float() / scale).clamp(-448.0, 448.0).to(E4M3).contiguous(), scale]
    return tuple(out)


def _quantize_case(r: int, c: int, what: str) -> Case:
    """One operand of a linear layer (x, W or dy of its shape) quantized both ways: ours in two passes over
    x (kernels.fp8.quantize), against PyTorch's casts under torch.compile. Bytes: x read once, both copies
    written (the least any kernel moves)."""
    return Case("fp8_quantize", f"{r}x{c} ({what})", torch.bfloat16,
                lambda: (torch.randn(r, c, device="cuda", dtype=torch.bfloat16),),
                ours=lambda x: quantize(x, E4M3, rows=True, cols=True),
                baselines={"torch.compile": compiled(_rows_and_columns_torch)},
                bytes={"fwd": 4.0 * r * c}, passes=("fwd",))


def _fp8_gemm_case(m: int, k: int, n: int, product: str) -> Case:
    def make_inputs():
        qa, sa, _, _ = quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), E4M3)
        qb, sb, _, _ = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5, E4M3)
        return qa, sa, qb, sb

    def ours(qa, sa, qb, sb):
        return gemm(qa, qb.t(), torch.empty(m, n, device="cuda", dtype=torch.bfloat16), a_scale=sa, b_scale=sb)

    def scaled_mm(qa, sa, qb, sb, fast_accum=False):
        return torch._scaled_mm(qa, qb.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum)

    bf16 = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    return Case("fp8_gemm", f"{m}x{k}x{n} ({product})", torch.float8_e4m3fn, make_inputs, ours=ours,
                baselines={"torch._scaled_mm": scaled_mm,
                           "_scaled_mm fast accum": lambda qa, sa, qb, sb: scaled_mm(qa, sa, qb, sb, True),
                           "cuBLAS bf16": lambda *_: F.linear(*bf16)},
                flops={"fwd": 2.0 * m * n * k}, passes=("fwd",))


def _torchao_linear(k: int, n: int):
    """torchao float8's rowwise Float8Linear of an [n, k] bias-free layer under torch.compile, called as
    ``(x, w)`` with the bench's weight ``w`` (a Parameter) as its own; None without torchao."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    layer = convert_to_float8_training(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16),
                                       config=Float8LinearConfig.from_recipe_name("rowwise"))
    step = compiled(layer)

    def call(x, w):
        layer.weight = w  # the bench's weight (a Parameter), so that its gradient is the baseline's too
        return step(x)
    return call


def _fp8_linear_case(m: int, k: int, n: int) -> Case:
    def make_inputs():
        return (torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                torch.nn.Parameter(random_weight(n, k, torch.bfloat16).detach()))

    baselines = {"tritonllm bf16": lambda x, w: linear(x, w), "cuBLAS bf16": F.linear}
    torchao = _torchao_linear(k, n)
    if torchao is not None:
        baselines["torchao rowwise+compile"] = torchao
    return Case("fp8_linear", f"{m}x{k}x{n}", torch.bfloat16, make_inputs, ours=lambda x, w: fp8_linear(x, w),
                baselines=baselines, flops=gemm_flops(m, n, k))


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
    """The quantization of each operand of each ``linear`` shape of ``size`` ("default" or "large"), the
    FP8 GEMM at the three products of those shapes, the FP8 layer at those shapes, the FP8 head at the
    ``linear_cross_entropy`` shapes."""
    if size not in SHAPES:
        raise ValueError(f"size must be one of {sorted(SHAPES)}, got {size!r}")
    for m, k, n in SHAPES[size]["linear"]:
        for (r, c), what in (((m, k), "x"), ((n, k), "W"), ((m, n), "dy")):
            yield _quantize_case(r, c, what)
    for m, k, n in SHAPES[size]["linear"]:
        for shape, product in (((m, k, n), "fwd"), ((m, n, k), "dx"), ((n, m, k), "dW")):
            yield _fp8_gemm_case(*shape, product)
    for shape in SHAPES[size]["linear"]:
        yield _fp8_linear_case(*shape)
    for shape in SHAPES[size]["linear_cross_entropy"]:
        yield _fp8_head_case(*shape, dtype)
