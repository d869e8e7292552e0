"""Linear layers on one Triton GEMM: ``linear`` (bias and residual epilogues) and ``linear_swiglu``.

Shapes: x [M, K] (leading dimensions folded into M), W [N, K] (PyTorch layout), b [N], r [M, N].

linear, forward:   y = x W^T + b + r
linear, backward:  dx = dy W,   dW = dy^T x,   db = sum_m dy[m, :],   dr = dy

linear_swiglu, with w13 [2F, K] = [W1; W3] (gate rows [0, F), up rows [F, 2F)):
  forward:   g = x W1^T,  u = x W3^T,  h = silu(g) * u,  silu(g) = g * sigmoid(g)
             (one GEMM with two accumulators, the gate and up tiles of the same output columns; its
             epilogue writes h and, when a gradient is needed, gu = [g, u] [M, 2F] for the backward)
  backward:  with s = sigmoid(g): dg = dh * u * s * (1 + g * (1 - s)),   du = dh * silu(g)
             dgu = [dg, du] by kernels.swiglu's packed backward, then dx = dgu w13, dw13 = dgu^T x
             (the FLOPs and bytes of the unfused cuBLAS GEMM + swiglu pair's backward)

The products are :func:`kernels.gemm.gemm` (the GEMM engine: configs, split-K, TMA); this module
adds the ops, their checks, autograd and the deterministic bias gradient (``sum_rows``).

Precision: fp32 accumulation for every dtype. float32 inputs use TF32 tensor cores on the GPU
(about 3e-4 relative error, like ``torch.backends.cuda.matmul.allow_tf32 = True``);
``allow_tf32=False`` selects IEEE fp32 dots. The bias gradient is reduced deterministically:
per-program partial sums over row groups, then a fixed-order sum of the partials.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_dot_dtype, check_same_device, check_same_dtype, check_tensor, needs_grad
from .device import hopper, num_sms, side_stream
from .custom_op import absent, compilable, compiled, define, fake, formula_function, given, n_rows, register_formula
from .gemm import SWIGLU_FWD, as_matrix, gemm
from .gemm_settings import gemm_settings
from .swiglu import swiglu_bwd


@triton.jit
def _sum_rows_kernel(
    x_ptr,  # [M, N] rows to sum, strides (stride_xm, stride_xn)
    out_ptr,  # [R, N] out[r] = sum of rows [r * rows_per_prog, (r + 1) * rows_per_prog), row stride stride_om
    M, N, rows_per_prog,  # rows_per_prog: a multiple of BLOCK_M
    stride_xm, stride_xn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    row_start = pid_r * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xn
        acc += tl.load(ptrs, mask=(rows < row_end)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_r.to(tl.int64) * stride_om + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=mask_n)


def sum_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.sum(0)`` of a 2-D tensor in fp32, deterministically: partial sums of row groups by
    parallel programs, then one fixed-order sum of the partials; returned in ``dtype``."""
    M, N = x.shape
    if M == 0:
        return torch.zeros(N, dtype=dtype, device=x.device)
    block_m, block_n = (64, 64) if interpreting() else (32, 128)
    col_blocks = triton.cdiv(N, block_n)
    groups = max(1, min(triton.cdiv(M, block_m), triton.cdiv(4 * num_sms(), col_blocks)))
    rows_per_prog = triton.cdiv(triton.cdiv(M, groups), block_m) * block_m
    groups = max(1, triton.cdiv(M, rows_per_prog))
    out = torch.empty((1, N), dtype=dtype, device=x.device)
    partial = out if groups == 1 else torch.empty((groups, N), dtype=torch.float32, device=x.device)
    _sum_rows_kernel[(col_blocks, groups)](x, partial, M, N, rows_per_prog, x.stride(0), x.stride(1),
                                           partial.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    if groups > 1:
        _sum_rows_kernel[(col_blocks, 1)](partial, out, groups, N, triton.cdiv(groups, block_m) * block_m,
                                          partial.stride(0), partial.stride(1), out.stride(0),
                                          BLOCK_M=block_m, BLOCK_N=block_n)
    return out.view(N)


def _beside(g: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`_input_weight_grads` runs dW beside dx (``GemmSettings.overlap_dw``, a Hopper GPU, few
    dW tiles)."""
    N, K = weight.shape
    return (gemm_settings().overlap_dw and g.is_cuda and hopper(g.device)
            and triton.cdiv(N, 128) * triton.cdiv(K, 256) < 2 * num_sms(g.device.index))


def check_linear_inputs(x: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight") -> None:
    """x [..., K] and a weight [N, K]: floating tensors on one device, one dtype, matching K."""
    check_tensor("x", x, min_ndim=1)
    check_tensor(weight_name, weight, ndim=2)
    check_same_device(x=x, **{weight_name: weight})
    check_same_dtype(x=x, **{weight_name: weight})
    check_dot_dtype("x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{weight_name} has shape {tuple(weight.shape)}: its second dimension must equal "
                         f"x's last dimension K={x.shape[-1]}")


def check_bias_residual(x: torch.Tensor, N: int, bias: torch.Tensor | None,
                        residual: torch.Tensor | None) -> tuple[int, ...]:
    """A bias [N] and a residual of the output's shape [..., N] (each optional) on x's device, in its dtype;
    returns the output's shape."""
    out_shape = tuple(x.shape[:-1]) + (N,)
    if bias is not None:
        check_tensor("bias", bias)
        check_same_device(x=x, bias=bias)
        check_same_dtype(x=x, bias=bias)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        check_tensor("residual", residual)
        check_same_device(x=x, residual=residual)
        check_same_dtype(x=x, residual=residual)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"residual must have the output's shape {out_shape}, got {tuple(residual.shape)}")
    return out_shape


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, allow_tf32: bool = True) -> torch.Tensor:
    """y = x @ weight.T (+ bias) (+ residual) for x [..., K], weight [N, K]; y [..., N] in x's dtype."""
    check_linear_inputs(x, weight)
    N, K = weight.shape
    out_shape = check_bias_residual(x, N, bias, residual)
    x2 = as_matrix(x, K)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    gemm(x2, weight.t(), y, bias=bias, residual=None if residual is None else as_matrix(residual, N),
         allow_tf32=allow_tf32)
    return y if x.dim() == 2 else y.view(out_shape)


def _input_weight_grads(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_dx: bool = True,
                       need_dw: bool = True, allow_tf32: bool = True):
    """(dx, dW) of a product y = x W^T from g = dL/dy [M, N] (rows of y): dx = g W (x's shape) and
    dW = g^T x (None where not needed); both needed and ``GemmSettings.overlap_dw``'s conditions met, dW runs on a second
    stream (:func:`device.side_stream`), launched first, beside dx on the current one."""
    N, K = weight.shape
    x2 = as_matrix(x, K)
    dx = dw = None
    beside = need_dx and need_dw and _beside(g, weight)
    if beside:
        current, side = torch.cuda.current_stream(g.device), side_stream(g.device)
        dw = torch.empty((N, K), dtype=weight.dtype, device=weight.device)  # on the current stream: see side_stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            gemm(g.t(), x2, dw, allow_tf32=allow_tf32, dynamic=True)
    elif need_dw:
        dw = gemm(g.t(), x2, torch.empty((N, K), dtype=weight.dtype, device=weight.device), allow_tf32=allow_tf32)
    if need_dx:
        dx = gemm(g, weight, torch.empty((g.shape[0], K), dtype=x.dtype, device=x.device), allow_tf32=allow_tf32,
                  dynamic=True if beside else None).view(x.shape)
    if beside:
        current.wait_stream(side)
    return dx, dw


def linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_dx: bool = True,
               need_dw: bool = True, need_db: bool = False, allow_tf32: bool = True):
    """(dx, dW, db) of y = x W^T + b: dx = dy W, dW = dy^T x, db = sum of dy's rows (None where not needed)."""
    dy2 = as_matrix(dy, weight.shape[0])
    dx, dw = _input_weight_grads(dy2, x, weight, need_dx, need_dw, allow_tf32)
    return dx, dw, sum_rows(dy2, weight.dtype) if need_db else None


def _linear_setup(ctx, inputs, output):
    """Saves x and the weight, and the last input as ``ctx.option``, the backward launcher's last argument
    (``allow_tf32`` here; ``grad_dtype`` for kernels.fp8_linear, which shares this pair)."""
    x, weight, _, _, ctx.option = inputs
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, dy, *, bwd=linear_bwd):
    """``(dx, dweight, dbias, dresidual, None)`` by ``bwd``: the launcher eagerly, the backward op under
    torch.compile (``dresidual`` is ``dy`` itself)."""
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db, need_dr = ctx.needs_input_grad[:4]
    dx, dw, db = bwd(dy, x, weight, need_dx, need_dw, need_db, ctx.option)
    return given(dx, need_dx), given(dw, need_dw), given(db, need_db), (dy if need_dr else None), None


LinearFunction = formula_function("LinearFunction", linear_fwd, _linear_setup, _linear_backward)


@compilable
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, *, allow_tf32: bool = True) -> torch.Tensor:
    """``y = x @ weight.T (+ bias) (+ residual)`` with Triton GEMMs forward and backward.

    x [..., K], weight [N, K] (``nn.Linear`` layout), bias [N], residual [..., N] (added in the
    GEMM's epilogue: ``residual + x @ W.T`` for attention/MLP output projections). All tensors
    share one floating dtype (fp32, fp16, bf16); returns [..., N] in that dtype. fp32 accumulation;
    fp32 inputs use TF32 tensor cores on the GPU unless ``allow_tf32=False``.
    Backward: dx = dy W, dW = dy^T x, db = sum of dy's rows (deterministic), d(residual) = dy.
    """
    if needs_grad(x, weight, bias, residual):
        return LinearFunction.apply(x, weight, bias, residual, allow_tf32)
    return linear_fwd(x, weight, bias, residual, allow_tf32)  # nothing to differentiate: no autograd node


def linear_swiglu_fwd(x: torch.Tensor, w13: torch.Tensor, allow_tf32: bool = True, store_gu: bool = False):
    """h = silu(x W1^T) * (x W3^T) for w13 = [W1; W3] [2F, K]: (h [..., F], gu) in x's dtype, gu the
    pre-activations [rows, 2F] when ``store_gu`` (for the backward), else None."""
    check_linear_inputs(x, w13, "w13")
    if w13.shape[0] % 2:
        raise ValueError(f"w13 must stack gate and up rows [2F, K]; got an odd first dimension {w13.shape[0]}")
    two_f, K = w13.shape
    x2 = as_matrix(x, K)
    h = torch.empty((x2.shape[0], two_f // 2), dtype=x.dtype, device=x.device)
    gu = torch.empty((x2.shape[0], two_f), dtype=x.dtype, device=x.device) if store_gu else None
    gemm(x2, w13.t(), h, gu=gu, epilogue=SWIGLU_FWD, allow_tf32=allow_tf32)
    return h.view(tuple(x.shape[:-1]) + (two_f // 2,)), gu


def linear_swiglu_bwd(dh: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, gu: torch.Tensor,
                      need_dx: bool = True, need_dw: bool = True, allow_tf32: bool = True):
    """(dx, dw13) from the forward's pre-activations gu [rows, 2F]: dgu = [dgate, dup] by
    kernels.swiglu's packed backward, then dx = dgu w13 and dw13 = dgu^T x (:func:`_input_weight_grads`)."""
    dgu = swiglu_bwd(as_matrix(dh, w13.shape[0] // 2), gu)
    return _input_weight_grads(dgu, x, w13, need_dx, need_dw, allow_tf32)


def _linear_swiglu_setup(ctx, inputs, output):
    """Saves x, w13 and the pre-activations ``output[1]``, and the last input as ``ctx.option`` (as
    :func:`_linear_setup`)."""
    x, w13, ctx.option = inputs
    ctx.save_for_backward(x, w13, output[1])


def _linear_swiglu_backward(ctx, dh, _dgu=None, *, bwd=linear_swiglu_bwd):
    """``(dx, dw13, None)`` by ``bwd`` from the stored pre-activations ``gu``: the launcher eagerly, the
    backward op under torch.compile."""
    x, w13, gu = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = bwd(dh, x, w13, gu, need_dx, need_dw, ctx.option)
    return given(dx, need_dx), given(dw, need_dw), None


class LinearSwiGLUFunction(torch.autograd.Function):
    """The launcher with :func:`_linear_swiglu_setup` and :func:`_linear_swiglu_backward`, the custom op's
    formula too; returns ``h`` (the op returns ``(h, gu)``)."""

    @staticmethod
    def forward(ctx, x, w13, allow_tf32):
        h, gu = linear_swiglu_fwd(x, w13, allow_tf32, store_gu=True)
        _linear_swiglu_setup(ctx, (x, w13, allow_tf32), (h, gu))
        return h

    @staticmethod
    def backward(ctx, dh):
        return _linear_swiglu_backward(ctx, dh)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::linear_fwd", mutates_args=())
def linear_fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                  allow_tf32: bool) -> Tensor:
    """``x @ weight.T (+ bias) (+ residual)``: :func:`kernels.linear.linear_fwd`."""
    return linear_fwd(x, weight, bias, residual, allow_tf32)


def linear_fwd_fake(x, weight, bias, residual, option):
    """The forward's output, shaped (kernels.fp8_linear's fake too: ``option`` its grad_dtype)."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


fake(linear_fwd_op)(linear_fwd_fake)


@define("tritonllm::linear_bwd", mutates_args=())
def linear_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool, need_dw: bool, need_db: bool,
                  allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of :func:`kernels.linear.linear_bwd`, absent where not needed."""
    grads = linear_bwd(dy, x, weight, need_dx, need_dw, need_db, allow_tf32)
    dx, dw, db = (g if g is not None else absent(x) for g in grads)
    return dx, dw, db


def linear_bwd_fake(dy, x, weight, need_dx, need_dw, need_db, option):
    """``(dx, dweight, dbias)`` shaped, absent where not needed (kernels.fp8_linear's fake too)."""
    return (x.new_empty(x.shape) if need_dx else absent(x), weight.new_empty(weight.shape) if need_dw else absent(x),
            weight.new_empty(weight.shape[0]) if need_db else absent(x))


fake(linear_bwd_op)(linear_bwd_fake)


register_formula(linear_fwd_op, _linear_setup, _linear_backward, bwd=linear_bwd_op)


@compiled("linear")
def _compiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, *,
                     allow_tf32: bool = True) -> Tensor:
    return linear_fwd_op(x, weight, bias, residual, allow_tf32)


@define("tritonllm::linear_swiglu_fwd", mutates_args=())
def linear_swiglu_fwd_op(x: Tensor, w13: Tensor, allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """``(h, gu)``: :func:`kernels.linear.linear_swiglu_fwd` with the pre-activations stored."""
    return linear_swiglu_fwd(x, w13, allow_tf32, store_gu=True)


def linear_swiglu_fwd_fake(x, w13, option):
    """``(h, gu)`` shaped (kernels.fp8_linear's fake too)."""
    two_f = w13.shape[0]
    return x.new_empty((*x.shape[:-1], two_f // 2)), x.new_empty((n_rows(x), two_f))


fake(linear_swiglu_fwd_op)(linear_swiglu_fwd_fake)


@define("tritonllm::linear_swiglu_bwd", mutates_args=())
def linear_swiglu_bwd_op(dh: Tensor, x: Tensor, w13: Tensor, gu: Tensor, need_dx: bool, need_dw: bool,
                         allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw13)`` of :func:`kernels.linear.linear_swiglu_bwd`, absent where not needed."""
    dx, dw = linear_swiglu_bwd(dh, x, w13, gu, need_dx, need_dw, allow_tf32)
    return (dx if dx is not None else absent(x)), (dw if dw is not None else absent(x))


def linear_swiglu_bwd_fake(dh, x, w13, gu, need_dx, need_dw, option):
    """``(dx, dw13)`` shaped, absent where not needed (kernels.fp8_linear's fake too)."""
    return x.new_empty(x.shape) if need_dx else absent(x), w13.new_empty(w13.shape) if need_dw else absent(x)


fake(linear_swiglu_bwd_op)(linear_swiglu_bwd_fake)


register_formula(linear_swiglu_fwd_op, _linear_swiglu_setup, _linear_swiglu_backward, bwd=linear_swiglu_bwd_op)


@compiled("linear_swiglu")
def _compiled_linear_swiglu(x: Tensor, w13: Tensor, *, allow_tf32: bool = True) -> Tensor:
    return linear_swiglu_fwd_op(x, w13, allow_tf32)[0]


@compilable
def linear_swiglu(x: torch.Tensor, w13: torch.Tensor, *, allow_tf32: bool = True) -> torch.Tensor:
    """SwiGLU MLP input projection ``silu(x @ W1.T) * (x @ W3.T)`` in one GEMM.

    x [..., K]; w13 [2F, K] stacks the gate weight W1 (rows [0, F)) over the up weight W3
    (rows [F, 2F)). Returns h [..., F] in x's dtype. When a gradient is needed the GEMM's epilogue
    also writes the [..., 2F] gate/up pre-activations (saved for the backward, as the unfused
    GEMM + swiglu pair saves its GEMM output); under no_grad only h is written.
    """
    if needs_grad(x, w13):
        return LinearSwiGLUFunction.apply(x, w13, allow_tf32)
    return linear_swiglu_fwd(x, w13, allow_tf32)[0]
