"""FP8 linear layers: ``y = x W^T (+ bias) (+ residual)`` with all three products of the layer (the
forward and both gradients) on fp8 operands, fp32 accumulation and output in x's dtype.

Rowwise scaling (torchao float8's "rowwise" recipe): each operand is quantized along the dimension
its GEMM contracts, one scale per row of the operand as the GEMM reads it (:mod:`kernels.fp8`:
``s = amax / F``, ``q = fp8(x / s)``), and the scales of the two operands multiply the product in the
GEMM's epilogue (``kernels.gemm.gemm`` with ``a_scale``/``b_scale``). For x [M, K], W [N, K], dy [M, N]::

    y  = s_x[m] s_W[n]        sum_k q(x)[m, k]     q(W)[n, k]       x rows, W rows over K
    dx = s_dy[m] s_Wt[k]      sum_n q(dy)[m, n]    q(W^T)[k, n]     dy rows, W columns over N
    dW = s_dyt[n] s_xt[k]     sum_m q(dy^T)[n, m]  q(x^T)[k, m]     dy columns, x columns over M

x and W take e4m3 (``float8_e4m3fn``, 3 mantissa bits, largest 448); the gradient dy takes
``grad_dtype``, e4m3 by default (torchao's rowwise recipe) or e5m2 (2 mantissa bits, range to 57344).
The transposed copies (W^T, dy^T, x^T) are written by the quantization kernel, which reads along the
input's unit stride and writes K-major operands, the layout Hopper's fp8 tensor cores take. The bias
gradient is the sum of dy's rows in dy's own precision; the residual's gradient is dy.

Under Triton's interpreter (no fp8 conversions) the quantized operands are float32 holding the fp8
values exactly (``kernels.fp8.fp8_round``), so the CPU runs the same math on the fp8 grid.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._interpreter import interpreting
from .checks import needs_grad
from .custom_op import absent, compilable, compiled, define, fake, register_formula
from .fp8 import FP8_MAX, quantize_rows
from .gemm import as_matrix, gemm
from .linear import (_linear_backward, _linear_setup, _linear_swiglu_backward, _linear_swiglu_setup, check_bias_residual,
                     check_linear_inputs, linear_bwd_fake, linear_fwd_fake, linear_swiglu_bwd_fake,
                     linear_swiglu_fwd_fake, sum_rows)
from .swiglu import swiglu_bwd, swiglu_fwd

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_supported(device: torch.device) -> bool:
    """fp8 tensor cores (compute capability 8.9: Ada, 9.0: Hopper, and later), or the interpreter's emulation."""
    return interpreting() if device.type != "cuda" else torch.cuda.get_device_capability(device) >= (8, 9)


def _check_grad_dtype(grad_dtype: torch.dtype) -> None:
    if grad_dtype not in FP8_MAX:
        raise TypeError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")


def _scaled_product(a: torch.Tensor, a_fmt: torch.dtype, b: torch.Tensor, b_fmt: torch.dtype,
                    out: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ b^T`` (+ bias) (+ residual) for a [M, C] and b [N, C] (any strides), each quantized per
    row over the contracted C to its fp8 format, the two row scales applied in the GEMM's epilogue."""
    qa, sa = quantize_rows(a, a_fmt)
    qb, sb = quantize_rows(b, b_fmt)
    return gemm(qa, qb.t(), out, bias=bias, residual=residual, a_scale=sa, b_scale=sb)


def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]) (+ residual [..., N]) on e4m3 operands
    scaled per row (module docstring), in x's dtype."""
    check_linear_inputs(x, weight)
    N, K = weight.shape
    out_shape = check_bias_residual(x, N, bias, residual)
    if not fp8_supported(x.device):
        raise ValueError(f"x is on {x.device}: fp8 linear layers need a GPU with fp8 tensor cores (compute "
                         "capability 8.9 or later), or Triton's interpreter on the CPU")
    x2 = as_matrix(x, K)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    _scaled_product(x2, E4M3, weight, E4M3, y, bias, None if residual is None else as_matrix(residual, N))
    return y.view(out_shape)


def fp8_linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_dx: bool = True,
                   need_dw: bool = True, need_db: bool = False, grad_dtype: torch.dtype = E4M3):
    """(dx, dW, db) of :func:`fp8_linear_fwd` (None where not needed): dx = dy W and dW = dy^T x on fp8
    operands (dy in ``grad_dtype``), db = the sum of dy's rows."""
    _check_grad_dtype(grad_dtype)
    N, K = weight.shape
    dy2, x2 = as_matrix(dy, N), as_matrix(x, K)
    dx = dw = None
    if need_dx:
        dx = _scaled_product(dy2, grad_dtype, weight.t(), E4M3,
                             torch.empty((dy2.shape[0], K), dtype=x.dtype, device=x.device)).view(x.shape)
    if need_dw:
        dw = _scaled_product(dy2.t(), grad_dtype, x2.t(), E4M3,
                             torch.empty((N, K), dtype=weight.dtype, device=weight.device))
    return dx, dw, sum_rows(dy2, weight.dtype) if need_db else None


class Fp8LinearFunction(torch.autograd.Function):
    """The launchers with kernels.linear's setup/backward pair (the launcher passed in), the custom op's formula too."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, grad_dtype):
        y = fp8_linear_fwd(x, weight, bias, residual)
        _linear_setup(ctx, (x, weight, bias, residual, grad_dtype), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _linear_backward(ctx, dy, bwd=fp8_linear_bwd)


@compilable
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, *, grad_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``y = x @ weight.T (+ bias) (+ residual)`` with the forward GEMM and both backward GEMMs in FP8.

    x [..., K], weight [N, K], bias [N], residual [..., N] share one floating dtype (bf16 in training);
    returns [..., N] in it. x and W are quantized to e4m3 per row over K, the gradient dy to
    ``grad_dtype`` (e4m3 or e5m2) per row over N for dx and per column over M for dW (module docstring);
    fp32 accumulation, scales applied in the epilogue. Needs fp8 tensor cores (sm_89 or later) or
    Triton's interpreter (fp8 emulated in float32).
    """
    _check_grad_dtype(grad_dtype)
    if needs_grad(x, weight, bias, residual):
        return Fp8LinearFunction.apply(x, weight, bias, residual, grad_dtype)
    return fp8_linear_fwd(x, weight, bias, residual)


def fp8_linear_swiglu_fwd(x: torch.Tensor, w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [..., F], gu [rows, 2F]): gu = x w13^T by :func:`fp8_linear_fwd` (the pre-activations, kept for
    the backward), h = silu(gate) * up of its halves (``kernels.swiglu``)."""
    check_linear_inputs(x, w13, "w13")
    if w13.shape[0] % 2:
        raise ValueError(f"w13 must stack gate and up rows [2F, K]; got an odd first dimension {w13.shape[0]}")
    gu = fp8_linear_fwd(as_matrix(x, w13.shape[1]), w13)
    return swiglu_fwd(gu).view(*x.shape[:-1], w13.shape[0] // 2), gu


def fp8_linear_swiglu_bwd(dh: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, gu: torch.Tensor,
                          need_dx: bool = True, need_dw: bool = True, grad_dtype: torch.dtype = E4M3):
    """(dx, dw13) from the forward's pre-activations gu [rows, 2F]: dgu = [dgate, dup] by kernels.swiglu's
    packed backward, then dx and dw13 by :func:`fp8_linear_bwd` (None where not needed)."""
    dgu = swiglu_bwd(as_matrix(dh, w13.shape[0] // 2), gu)
    return fp8_linear_bwd(dgu, x, w13, need_dx, need_dw, grad_dtype=grad_dtype)[:2]


class Fp8LinearSwiGLUFunction(torch.autograd.Function):
    """The launchers with kernels.linear's linear_swiglu setup/backward pair (the launcher passed in), the custom
    op's formula too."""

    @staticmethod
    def forward(ctx, x, w13, grad_dtype):
        h, gu = fp8_linear_swiglu_fwd(x, w13)
        _linear_swiglu_setup(ctx, (x, w13, grad_dtype), (h, gu))
        return h

    @staticmethod
    def backward(ctx, dh):
        return _linear_swiglu_backward(ctx, dh, bwd=fp8_linear_swiglu_bwd)


@compilable
def fp8_linear_swiglu(x: torch.Tensor, w13: torch.Tensor, *, grad_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``silu(x @ W1.T) * (x @ W3.T)`` for w13 = [W1; W3] [2F, K] (as ``kernels.linear.linear_swiglu``)
    with the GEMMs in FP8 (:func:`fp8_linear`); the SwiGLU runs on the bf16 pre-activations, which the
    backward keeps. Returns h [..., F] in x's dtype."""
    _check_grad_dtype(grad_dtype)
    if needs_grad(x, w13):
        return Fp8LinearSwiGLUFunction.apply(x, w13, grad_dtype)
    return fp8_linear_swiglu_fwd(x, w13)[0]


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functionals to the functions registered by @compiled while torch.compile traces.

@define("tritonllm::fp8_linear_fwd", mutates_args=())
def fp8_linear_fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                      grad_dtype: torch.dtype) -> Tensor:
    """:func:`kernels.fp8_linear.fp8_linear_fwd` (``grad_dtype`` is the backward's, kept for its formula)."""
    return fp8_linear_fwd(x, weight, bias, residual)


fake(fp8_linear_fwd_op)(linear_fwd_fake)


@define("tritonllm::fp8_linear_bwd", mutates_args=())
def fp8_linear_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool, need_dw: bool, need_db: bool,
                      grad_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of :func:`kernels.fp8_linear.fp8_linear_bwd`, absent where not needed."""
    dx, dw, db = (g if g is not None else absent(x)
                  for g in fp8_linear_bwd(dy, x, weight, need_dx, need_dw, need_db, grad_dtype))
    return dx, dw, db


fake(fp8_linear_bwd_op)(linear_bwd_fake)


register_formula(fp8_linear_fwd_op, _linear_setup, _linear_backward, bwd=fp8_linear_bwd_op)


@compiled("fp8_linear")
def _compiled_fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, *,
                         grad_dtype: torch.dtype = E4M3) -> Tensor:
    _check_grad_dtype(grad_dtype)
    return fp8_linear_fwd_op(x, weight, bias, residual, grad_dtype)


@define("tritonllm::fp8_linear_swiglu_fwd", mutates_args=())
def fp8_linear_swiglu_fwd_op(x: Tensor, w13: Tensor, grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(h, gu)`` of :func:`kernels.fp8_linear.fp8_linear_swiglu_fwd`."""
    return fp8_linear_swiglu_fwd(x, w13)


fake(fp8_linear_swiglu_fwd_op)(linear_swiglu_fwd_fake)


@define("tritonllm::fp8_linear_swiglu_bwd", mutates_args=())
def fp8_linear_swiglu_bwd_op(dh: Tensor, x: Tensor, w13: Tensor, gu: Tensor, need_dx: bool, need_dw: bool,
                             grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx, dw13)`` of :func:`kernels.fp8_linear.fp8_linear_swiglu_bwd`, absent where not needed."""
    dx, dw = (g if g is not None else absent(x)
              for g in fp8_linear_swiglu_bwd(dh, x, w13, gu, need_dx, need_dw, grad_dtype))
    return dx, dw


fake(fp8_linear_swiglu_bwd_op)(linear_swiglu_bwd_fake)


register_formula(fp8_linear_swiglu_fwd_op, _linear_swiglu_setup, _linear_swiglu_backward, bwd=fp8_linear_swiglu_bwd_op)


@compiled("fp8_linear_swiglu")
def _compiled_fp8_linear_swiglu(x: Tensor, w13: Tensor, *, grad_dtype: torch.dtype = E4M3) -> Tensor:
    _check_grad_dtype(grad_dtype)
    return fp8_linear_swiglu_fwd_op(x, w13, grad_dtype)[0]
