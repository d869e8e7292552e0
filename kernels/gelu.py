"""GELU with the tanh approximation, ``y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, elementwise
with fp32 math (the MLP activation of GPT-2 and Gemma; PyTorch's ``F.gelu(x, approximate="tanh")``).

Forward: with ``c = sqrt(2/pi)``, ``a = 0.044715``, ``u = c (x + a x^3)`` and ``t = tanh(u)``:
``y = x (1 + t) / 2``. Backward (from the saved input, since ``t`` is cheaper to recompute than to
store): ``dx = dy ((1 + t) / 2 + x (1 - t^2) c (1 + 3 a x^2) / 2)``, the second term taken as 0 where ``t`` is
saturated (``|t| = 1`` in fp32, ``|x| > 5`` or so, where ``x^3`` may overflow). ``tanh`` is
:func:`kernels.softcap.softcap_math` at cap 1 (no overflow for any ``u``). The kernels see the operand
as one flat contiguous run of elements; ``BLOCK`` per program.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .custom_op import compilable
from ._elementwise import unary_op
from .softcap import softcap_math

#: sqrt(2 / pi) and the cubic coefficient of the approximation
SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(math.sqrt(2.0 / math.pi))
CUBIC: tl.constexpr = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh_fwd_kernel(
    x_ptr,      # [N] input
    y_ptr,      # out: [N] x (1 + tanh(u)) / 2
    N,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = softcap_math((x + x * x * x * CUBIC) * SQRT_2_OVER_PI, 1.0)
    tl.store(y_ptr + offs, (0.5 * x * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_bwd_kernel(
    x_ptr,      # [N] forward input
    dy_ptr,     # [N] gradient of the output
    dx_ptr,     # out: [N] dy ((1 + t) / 2 + x (1 - t^2) c (1 + 3 a x^2) / 2)
    N,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = x * x
    t = softcap_math((x + x2 * x * CUBIC) * SQRT_2_OVER_PI, 1.0)
    # the second term only where tanh is not saturated: beyond, x^2 may overflow and 0 * inf is NaN
    sech2 = 1.0 - t * t
    grad = 0.5 * (1.0 + t) + tl.where(sech2 > 0.0, 0.5 * x * sech2 * SQRT_2_OVER_PI * (1.0 + x2 * (3.0 * CUBIC)), 0.0)
    tl.store(dx_ptr + offs, (dy * grad).to(dx_ptr.dtype.element_ty), mask=mask)


# the launchers, the custom ops tritonllm::gelu_tanh_fwd / gelu_tanh_bwd for torch.compile (with their fakes, formula
# and compiled functional) and the eager functional: kernels/_elementwise.py's unary_op
gelu_tanh_fwd, gelu_tanh_bwd, _gelu_tanh = unary_op("gelu_tanh", _gelu_tanh_fwd_kernel, _gelu_tanh_bwd_kernel)


@compilable
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation of a contiguous tensor (fp32 math), differentiable: what
    ``F.gelu(x, approximate="tanh")`` computes."""
    return _gelu_tanh(x)
