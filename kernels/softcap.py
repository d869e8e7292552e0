"""Logit soft-capping, ``y = cap * tanh(x / cap)``, elementwise with fp32 math (Gemma 2; modded-nanogpt's
LM head): smooth, odd, ``y ~ x`` for ``|x| << cap`` and ``|y| < cap`` always.

Forward: ``y = cap tanh(x / cap)``. Backward (from the saved output): ``dx = dy (1 - (y / cap)^2)``.
tanh is evaluated as ``sign(u) (1 - e) / (1 + e)`` with ``e = exp(-2 |u|)`` (no overflow for any u;
absolute error of a few fp32 ulps of 1). :func:`softcap_math` is the same formula for other kernels
(``kernels.linear_cross_entropy`` caps its logits with it). The kernels see the operand as one flat
contiguous run of elements; ``BLOCK`` per program.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
import triton
import triton.language as tl

from .checks import needs_grad
from .custom_op import compilable, compiled, define, fake, formula_function, register_formula
from ._elementwise import elementwise_bwd, elementwise_fwd


@triton.jit
def softcap_math(x, cap):
    """``cap * tanh(x / cap)`` of fp32 ``x`` (any shape), ``cap > 0``."""
    e = tl.exp(-2.0 * tl.abs(x) / cap)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _softcap_fwd_kernel(
    x_ptr,      # [N] input
    y_ptr,      # out: [N] cap tanh(x / cap)
    N,
    cap,        # fp32 cap > 0
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, softcap_math(x, cap).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softcap_bwd_kernel(
    y_ptr,      # [N] forward output
    dy_ptr,     # [N] gradient of the output
    dx_ptr,     # out: [N] dy (1 - (y / cap)^2)
    N,
    cap,        # fp32 cap > 0
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    t = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32) / cap
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (dy * (1.0 - t * t)).to(dx_ptr.dtype.element_ty), mask=mask)


def check_cap(cap) -> float:
    """``cap`` as a float; a ValueError naming it unless it is a finite number > 0."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    return float(cap)


def softcap_fwd(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` of a contiguous fp32/fp16/bf16 tensor, in its dtype."""
    return elementwise_fwd(_softcap_fwd_kernel, x, check_cap(cap))


def softcap_bwd(y: torch.Tensor, dy: torch.Tensor, cap: float) -> torch.Tensor:
    """``dy * (1 - (y / cap)^2)`` from the forward's output ``y`` (``dy`` made contiguous), in y's dtype."""
    return elementwise_bwd(_softcap_bwd_kernel, y, "y", dy, check_cap(cap))


def _softcap_setup(ctx, inputs, output):
    ctx.cap = inputs[1]
    ctx.save_for_backward(output)


def _softcap_backward(ctx, dy, *, bwd=softcap_bwd):
    """``(dx, None)`` by ``bwd`` from the saved output: the launcher eagerly, the backward op under
    torch.compile."""
    return bwd(ctx.saved_tensors[0], dy, ctx.cap), None


SoftcapFunction = formula_function("SoftcapFunction", softcap_fwd, _softcap_setup, _softcap_backward)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::softcap_fwd", mutates_args=())
def softcap_fwd_op(x: Tensor, cap: float) -> Tensor:
    """:func:`kernels.softcap.softcap_fwd`."""
    return softcap_fwd(x, cap)


@define("tritonllm::softcap_bwd", mutates_args=())
def softcap_bwd_op(y: Tensor, dy: Tensor, cap: float) -> Tensor:
    """:func:`kernels.softcap.softcap_bwd` (from the forward's output ``y``)."""
    return softcap_bwd(y, dy, cap)


for _op in (softcap_fwd_op, softcap_bwd_op):
    fake(_op)(lambda x, *args: x.new_empty(x.shape))


register_formula(softcap_fwd_op, _softcap_setup, _softcap_backward, bwd=softcap_bwd_op)


@compiled("softcap")
def _compiled_softcap(x: Tensor, cap: float) -> Tensor:
    return softcap_fwd_op(x, cap)


@compilable
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Soft-capped ``cap * tanh(x / cap)`` of a contiguous tensor (fp32 math), differentiable in x;
    ``cap`` a number > 0."""
    if needs_grad(x):
        return SoftcapFunction.apply(x, cap)
    return softcap_fwd(x, cap)
