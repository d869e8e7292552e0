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
Each of x, W and dy is quantized both ways from one pair of passes (``kernels.fp8.quantize``): the
forward writes q(x) and q(W) for y, and the per-column copies q(x^T) and q(W^T), K-major as Hopper's
fp8 tensor cores take them, which the backward keeps instead of x and W (one byte an element where x
took two; only the copies a gradient needs). The bias gradient is the sum of dy's rows in dy's own
precision; the residual's gradient is dy.

Under Triton's interpreter (no fp8 conversions) the quantized operands are float32 holding the fp8
values exactly (``kernels.fp8.fp8_round``), so the CPU runs the same math on the fp8 grid.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._interpreter import interpreting
from .checks import needs_grad
from .custom_op import absent, compilable, compiled, define, fake, given, n_rows, register_formula
from .fp8 import FP8_MAX, quantize
from .gemm import as_matrix, gemm
from .linear import check_bias_residual, check_linear_inputs, sum_rows
from .swiglu import swiglu_bwd, swiglu_fwd

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_supported(device: torch.device) -> bool:
    """fp8 tensor cores (compute capability 8.9: Ada, 9.0: Hopper, and later), or the interpreter's emulation."""
    return interpreting() if device.type != "cuda" else torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_device(x: torch.Tensor) -> None:
    """A ValueError unless x's device has fp8 tensor cores (or the interpreter emulates them)."""
    if not fp8_supported(x.device):
        raise ValueError(f"x is on {x.device}: fp8 linear layers need a GPU with fp8 tensor cores (compute "
                         "capability 8.9 or later), or Triton's interpreter on the CPU")


def _check_grad_dtype(grad_dtype: torch.dtype) -> None:
    if grad_dtype not in FP8_MAX:
        raise TypeError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")


def _fp8_dtype(fmt: torch.dtype) -> torch.dtype:
    """The dtype quantized operands of ``fmt`` have: float32 under the interpreter (kernels.fp8)."""
    return torch.float32 if interpreting() else fmt


def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, keep_x: bool = False, keep_w: bool = False):
    """``(y, xt, sxt, wt, swt)``: y [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]) (+ residual
    [..., N]) on e4m3 operands scaled per row (module docstring), in x's dtype; with ``keep_x`` the
    per-column e4m3 copy of x that dW needs (xt = q(x^T) [K, M], sxt [K]), with ``keep_w`` W's that dx
    needs (wt = q(W^T) [K, N], swt [K]); absent (0 elements) otherwise."""
    check_linear_inputs(x, weight)
    N, K = weight.shape
    out_shape = check_bias_residual(x, N, bias, residual)
    check_fp8_device(x)
    x2 = as_matrix(x, K)
    qx, sx, xt, sxt = quantize(x2, E4M3, rows=True, cols=keep_x)
    qw, sw, wt, swt = quantize(weight, E4M3, rows=True, cols=keep_w)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    gemm(qx, qw.t(), y, bias=bias, residual=None if residual is None else as_matrix(residual, N), a_scale=sx,
         b_scale=sw)
    return (y.view(out_shape), *(t if t is not None else absent(x) for t in (xt, sxt, wt, swt)))


def fp8_linear_bwd(dy: torch.Tensor, xt: torch.Tensor, sxt: torch.Tensor, wt: torch.Tensor, swt: torch.Tensor,
                   need_dx: bool = True, need_dw: bool = True, need_db: bool = False,
                   grad_dtype: torch.dtype = E4M3, w_dtype: torch.dtype | None = None):
    """(dx [M, K], dW [N, K], db [N]) of :func:`fp8_linear_fwd` from its kept copies xt [K, M] (for dW)
    and wt [K, N] (for dx), None where not needed: dy [..., N] quantized to ``grad_dtype`` per row
    (for dx = dy W) and per column (for dW = dy^T x) in one pair of passes; db = the sum of dy's rows.
    dW and db in ``w_dtype`` (default dy's)."""
    _check_grad_dtype(grad_dtype)
    N = dy.shape[-1]
    dy2 = as_matrix(dy, N)
    w_dtype = w_dtype or dy.dtype
    qdy, sdy, qdyt, sdyt = quantize(dy2, grad_dtype, rows=need_dx, cols=need_dw)
    dx = dw = None
    if need_dx:
        dx = gemm(qdy, wt.t(), torch.empty((dy2.shape[0], wt.shape[0]), dtype=dy.dtype, device=dy.device),
                  a_scale=sdy, b_scale=swt)
    if need_dw:
        dw = gemm(qdyt, xt.t(), torch.empty((N, xt.shape[0]), dtype=w_dtype, device=dy.device), a_scale=sdyt,
                  b_scale=sxt)
    return dx, dw, sum_rows(dy2, w_dtype) if need_db else None


def _fp8_setup(ctx, inputs, output):
    """Saves the forward's kept fp8 copies ``output[1:]`` (the pre-activations too for linear_swiglu),
    x's shape, the weight's dtype and ``grad_dtype`` (third from last input, before keep_x, keep_w)."""
    x, weight = inputs[:2]
    ctx.x_shape, ctx.w_dtype, ctx.grad_dtype = x.shape, weight.dtype, inputs[-3]
    ctx.save_for_backward(*output[1:])


def _fp8_linear_backward(ctx, dy, *_, bwd=fp8_linear_bwd):
    """``(dx, dweight, dbias, dresidual, None, None, None)`` by ``bwd``: the launcher eagerly, the backward
    op under torch.compile (``dresidual`` is ``dy`` itself)."""
    need_dx, need_dw, need_db, need_dr = ctx.needs_input_grad[:4]
    dx, dw, db = bwd(dy, *ctx.saved_tensors, need_dx, need_dw, need_db, ctx.grad_dtype, ctx.w_dtype)
    return (dx.view(ctx.x_shape) if need_dx else None), given(dw, need_dw), given(db, need_db), \
        (dy if need_dr else None), None, None, None


def _fp8_function(name: str, fwd, backward) -> type[torch.autograd.Function]:
    """The eager autograd Function ``name`` of an fp8 op, called as ``(*inputs, grad_dtype)``: its forward runs
    ``fwd(*inputs, keep_x, keep_w)``, keeping the copies the needed gradients take (x's for dW when the weight
    needs one, W's for dx when x does), and :func:`_fp8_setup`; returns the op's first output. Its backward is
    ``backward``, the pair the custom op's formula has too (the grads of the Function's inputs)."""
    def forward(ctx, *args):
        *inputs, grad_dtype = args
        keep = (ctx.needs_input_grad[1], ctx.needs_input_grad[0])
        out = fwd(*inputs, *keep)
        _fp8_setup(ctx, (*inputs, grad_dtype, *keep), out)
        return out[0]

    def backward_(ctx, grad):
        return backward(ctx, grad)[:len(ctx.needs_input_grad)]

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_),
                                                   "__doc__": f"``{fwd.__name__}`` with the custom op's formula pair."})


Fp8LinearFunction = _fp8_function("Fp8LinearFunction", fp8_linear_fwd, _fp8_linear_backward)


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
    return fp8_linear_fwd(x, weight, bias, residual)[0]


def fp8_linear_swiglu_fwd(x: torch.Tensor, w13: torch.Tensor, keep_x: bool = False, keep_w: bool = False):
    """``(h [..., F], gu [rows, 2F], xt, sxt, wt, swt)``: gu = x w13^T by :func:`fp8_linear_fwd` (the
    pre-activations, kept for the backward, with its fp8 copies), h = silu(gate) * up of its halves."""
    check_linear_inputs(x, w13, "w13")
    if w13.shape[0] % 2:
        raise ValueError(f"w13 must stack gate and up rows [2F, K]; got an odd first dimension {w13.shape[0]}")
    gu, *kept = fp8_linear_fwd(as_matrix(x, w13.shape[1]), w13, keep_x=keep_x, keep_w=keep_w)
    return (swiglu_fwd(gu).view(*x.shape[:-1], w13.shape[0] // 2), gu, *kept)


def fp8_linear_swiglu_bwd(dh: torch.Tensor, gu: torch.Tensor, xt: torch.Tensor, sxt: torch.Tensor, wt: torch.Tensor,
                          swt: torch.Tensor, need_dx: bool = True, need_dw: bool = True,
                          grad_dtype: torch.dtype = E4M3, w_dtype: torch.dtype | None = None):
    """(dx [rows, K], dw13) from the forward's pre-activations gu [rows, 2F] and kept copies: dgu = [dgate,
    dup] by kernels.swiglu's packed backward, then :func:`fp8_linear_bwd` (None where not needed)."""
    dgu = swiglu_bwd(as_matrix(dh, gu.shape[1] // 2), gu)
    return fp8_linear_bwd(dgu, xt, sxt, wt, swt, need_dx, need_dw, False, grad_dtype, w_dtype)[:2]


def _fp8_linear_swiglu_backward(ctx, dh, *_, bwd=fp8_linear_swiglu_bwd):
    """``(dx, dw13, None, None, None)`` by ``bwd`` from the saved pre-activations and copies."""
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = bwd(dh, *ctx.saved_tensors, need_dx, need_dw, ctx.grad_dtype, ctx.w_dtype)
    return (dx.view(ctx.x_shape) if need_dx else None), given(dw, need_dw), None, None, None


Fp8LinearSwiGLUFunction = _fp8_function("Fp8LinearSwiGLUFunction", fp8_linear_swiglu_fwd, _fp8_linear_swiglu_backward)


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

def _kept_fake(x: Tensor, K: int, N: int, keep_x: bool, keep_w: bool) -> list[Tensor]:
    """(xt, sxt, wt, swt) of :func:`fp8_linear_fwd`, shaped, absent where not kept."""
    q, rows = _fp8_dtype(E4M3), n_rows(x)
    xt = [x.new_empty((K, rows), dtype=q), x.new_empty(K, dtype=torch.float32)] if keep_x else [absent(x), absent(x)]
    wt = [x.new_empty((K, N), dtype=q), x.new_empty(K, dtype=torch.float32)] if keep_w else [absent(x), absent(x)]
    return xt + wt


@define("tritonllm::fp8_linear_fwd", mutates_args=())
def fp8_linear_fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                      grad_dtype: torch.dtype, keep_x: bool, keep_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                     Tensor]:
    """:func:`kernels.fp8_linear.fp8_linear_fwd` (``grad_dtype`` is the backward's, kept for its formula)."""
    return fp8_linear_fwd(x, weight, bias, residual, keep_x, keep_w)


@fake(fp8_linear_fwd_op)
def _(x, weight, bias, residual, grad_dtype, keep_x, keep_w):
    N, K = weight.shape
    return (x.new_empty((*x.shape[:-1], N)), *_kept_fake(x, K, N, keep_x, keep_w))


@define("tritonllm::fp8_linear_bwd", mutates_args=())
def fp8_linear_bwd_op(dy: Tensor, xt: Tensor, sxt: Tensor, wt: Tensor, swt: Tensor, need_dx: bool, need_dw: bool,
                      need_db: bool, grad_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of :func:`kernels.fp8_linear.fp8_linear_bwd`, absent where not needed."""
    dx, dw, db = (g if g is not None else absent(dy)
                  for g in fp8_linear_bwd(dy, xt, sxt, wt, swt, need_dx, need_dw, need_db, grad_dtype, w_dtype))
    return dx, dw, db


@fake(fp8_linear_bwd_op)
def _(dy, xt, sxt, wt, swt, need_dx, need_dw, need_db, grad_dtype, w_dtype):
    N, rows = dy.shape[-1], n_rows(dy)
    return (dy.new_empty((rows, wt.shape[0])) if need_dx else absent(dy),
            dy.new_empty((N, xt.shape[0]), dtype=w_dtype) if need_dw else absent(dy),
            dy.new_empty(N, dtype=w_dtype) if need_db else absent(dy))


register_formula(fp8_linear_fwd_op, _fp8_setup, _fp8_linear_backward, bwd=fp8_linear_bwd_op)


@compiled("fp8_linear")
def _compiled_fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, *,
                         grad_dtype: torch.dtype = E4M3) -> Tensor:
    _check_grad_dtype(grad_dtype)
    return fp8_linear_fwd_op(x, weight, bias, residual, grad_dtype, weight.requires_grad, x.requires_grad)[0]


@define("tritonllm::fp8_linear_swiglu_fwd", mutates_args=())
def fp8_linear_swiglu_fwd_op(x: Tensor, w13: Tensor, grad_dtype: torch.dtype, keep_x: bool,
                             keep_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(h, gu, xt, sxt, wt, swt)`` of :func:`kernels.fp8_linear.fp8_linear_swiglu_fwd`."""
    return fp8_linear_swiglu_fwd(x, w13, keep_x, keep_w)


@fake(fp8_linear_swiglu_fwd_op)
def _(x, w13, grad_dtype, keep_x, keep_w):
    two_f, K = w13.shape
    return (x.new_empty((*x.shape[:-1], two_f // 2)), x.new_empty((n_rows(x), two_f)),
            *_kept_fake(x, K, two_f, keep_x, keep_w))


@define("tritonllm::fp8_linear_swiglu_bwd", mutates_args=())
def fp8_linear_swiglu_bwd_op(dh: Tensor, gu: Tensor, xt: Tensor, sxt: Tensor, wt: Tensor, swt: Tensor, need_dx: bool,
                             need_dw: bool, grad_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx, dw13)`` of :func:`kernels.fp8_linear.fp8_linear_swiglu_bwd`, absent where not needed."""
    dx, dw = (g if g is not None else absent(dh)
              for g in fp8_linear_swiglu_bwd(dh, gu, xt, sxt, wt, swt, need_dx, need_dw, grad_dtype, w_dtype))
    return dx, dw


@fake(fp8_linear_swiglu_bwd_op)
def _(dh, gu, xt, sxt, wt, swt, need_dx, need_dw, grad_dtype, w_dtype):
    return (dh.new_empty((gu.shape[0], wt.shape[0])) if need_dx else absent(dh),
            dh.new_empty((gu.shape[1], xt.shape[0]), dtype=w_dtype) if need_dw else absent(dh))


register_formula(fp8_linear_swiglu_fwd_op, _fp8_setup, _fp8_linear_swiglu_backward, bwd=fp8_linear_swiglu_bwd_op)


@compiled("fp8_linear_swiglu")
def _compiled_fp8_linear_swiglu(x: Tensor, w13: Tensor, *, grad_dtype: torch.dtype = E4M3) -> Tensor:
    _check_grad_dtype(grad_dtype)
    return fp8_linear_swiglu_fwd_op(x, w13, grad_dtype, w13.requires_grad, x.requires_grad)[0]
