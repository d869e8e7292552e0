"""SwiGLU gating: ``y = silu(gate) * up``, elementwise, with fp32 math.

Forward, with ``s = sigmoid(g)``::

    y = g * s * u

Backward (sigmoid recomputed from the saved inputs; nothing else is saved)::

    dgate = dy * u * s * (1 + g * (1 - s))
    dup   = dy * g * s

Two calling forms share one kernel family: ``swiglu(gate, up)`` with two ``[..., F]`` tensors,
and the packed ``swiglu(gate_up)`` with one ``[..., 2F]`` tensor whose first half is the gate and
second half the up projection; its backward writes one ``[..., 2F]`` gradient. The kernels see
every operand as ``[R, C]`` rows with a row stride, so the packed halves are strided views, never
copies. When every operand is contiguous the launcher passes a single row of ``rows * F``
elements: a flat 1-D grid over large blocks. Reference: Shazeer, "GLU Variants Improve
Transformer" (2020); Liger-Kernel ``ops/swiglu.py``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_same_device, check_same_dtype, check_tensor, needs_grad, rows_view
from .launch import Launch, Plans, next_pow2
from .custom_op import absent, compilable, compiled, define, fake, formula_function, register_formula

#: Elements per program (BLOCK_M * BLOCK_C) and warps on the GPU.
_TILE = 4096
_NUM_WARPS = 8
#: Under the interpreter cost grows with the number of programs: larger tiles.
_INTERP_TILE = 65536


@triton.jit
def _tile(R, C, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile: first row and column (int64), in-tile row/column indices, mask."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(C, BLOCK_C)
    row0 = (pid // col_blocks).to(tl.int64) * BLOCK_M
    col0 = (pid % col_blocks).to(tl.int64) * BLOCK_C
    rm = tl.arange(0, BLOCK_M)
    rc = tl.arange(0, BLOCK_C)
    # rows / columns left in this tile, as int32 so that the mask compares int32 vectors
    rows_left = tl.minimum(R - row0, BLOCK_M).to(tl.int32)
    cols_left = tl.minimum(C - col0, BLOCK_C).to(tl.int32)
    mask = (rm < rows_left)[:, None] & (rc < cols_left)[None, :]
    return row0, col0, rm, rc, mask


@triton.jit
def _ptrs(base, stride, row0, col0, rm, rc):
    """Pointers of the tile at (row0, col0) of a row-major operand with row stride ``stride``."""
    return base + (row0 * stride + col0) + (rm[:, None] * stride + rc[None, :])


@triton.jit
def _swiglu_fwd_kernel(
    G,          # [R, C] gate, last dim contiguous
    U,          # [R, C] up, last dim contiguous
    Y,          # [R, C] output
    stride_g,   # row stride of G in elements
    stride_u,   # row stride of U in elements
    stride_y,   # row stride of Y in elements
    R, C,
    BLOCK_M: tl.constexpr,    # rows per program
    BLOCK_C: tl.constexpr,    # columns per program (power of two)
):
    row0, col0, rm, rc, mask = _tile(R, C, BLOCK_M, BLOCK_C)
    g = tl.load(_ptrs(G, stride_g, row0, col0, rm, rc), mask=mask).to(tl.float32)
    u = tl.load(_ptrs(U, stride_u, row0, col0, rm, rc), mask=mask).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(_ptrs(Y, stride_y, row0, col0, rm, rc), y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    G,          # [R, C] gate saved by the forward, last dim contiguous
    U,          # [R, C] up saved by the forward, last dim contiguous
    DY,         # [R, C] gradient of y, last dim contiguous
    DG,         # [R, C] output gradient of gate
    DU,         # [R, C] output gradient of up
    stride_g,   # row stride of G in elements
    stride_u,   # row stride of U in elements
    stride_dy,  # row stride of DY in elements
    stride_dg,  # row stride of DG in elements
    stride_du,  # row stride of DU in elements
    R, C,
    BLOCK_M: tl.constexpr,    # rows per program
    BLOCK_C: tl.constexpr,    # columns per program (power of two)
):
    row0, col0, rm, rc, mask = _tile(R, C, BLOCK_M, BLOCK_C)
    g = tl.load(_ptrs(G, stride_g, row0, col0, rm, rc), mask=mask).to(tl.float32)
    u = tl.load(_ptrs(U, stride_u, row0, col0, rm, rc), mask=mask).to(tl.float32)
    dy = tl.load(_ptrs(DY, stride_dy, row0, col0, rm, rc), mask=mask).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(_ptrs(DG, stride_dg, row0, col0, rm, rc), dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(_ptrs(DU, stride_du, row0, col0, rm, rc), du.to(DU.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=256)
def _plan(rows: int, cols: int, tile: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_C, programs)`` for ``[rows, cols]`` operands and tiles of ``tile`` elements."""
    block_c = min(max(next_pow2(cols), 16), tile)
    block_m = min(tile // block_c, next_pow2(rows))
    return block_m, block_c, triton.cdiv(rows, block_m) * triton.cdiv(cols, block_c)


#: launch plans per (kernel, rows, columns, row strides, knobs)
_PLANS = Plans()


def _launch(kernel, *views: torch.Tensor) -> None:
    """Run ``kernel`` over ``[M, F]`` views (last dim contiguous): as one flat row of ``M * F``
    elements when every view is contiguous, else as ``M`` strided rows."""
    m, f = views[0].shape
    if m * f == 0:
        return
    strides = tuple(v.stride(0) for v in views)
    flat = m == 1 or strides.count(f) == len(strides)
    rows, cols = (1, m * f) if flat else (m, f)
    tile = _INTERP_TILE if interpreting() else _TILE
    key = (kernel, rows, cols, strides, tile, _NUM_WARPS)
    plan = _PLANS.get(key)
    if plan is None:
        block_m, block_c, programs = _plan(rows, cols, tile)
        plan = _PLANS.add(key, Launch(kernel, (programs,), BLOCK_M=block_m, BLOCK_C=block_c, num_warps=_NUM_WARPS))
    plan(*views, *strides, rows, cols)


def _check_inputs(gate: torch.Tensor, up: torch.Tensor | None) -> int:
    """Validate the two-tensor or packed form; return F, the width of y."""
    if up is None:
        check_tensor("gate_up", gate, min_ndim=1)
        if gate.shape[-1] % 2:
            raise ValueError("gate_up (swiglu called with one tensor) must have an even last dimension "
                             f"[..., 2F], got shape {tuple(gate.shape)}")
        return gate.shape[-1] // 2
    check_tensor("gate", gate, min_ndim=1)
    check_tensor("up", up)
    check_same_device(gate=gate, up=up)
    check_same_dtype(gate=gate, up=up)
    if up.shape != gate.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    return gate.shape[-1]


def _halves(gate: torch.Tensor, up: torch.Tensor | None, f: int):
    """``[M, F]`` gate and up views: the two tensors, or the halves of the packed one."""
    if up is None:
        packed = rows_view(gate, 2 * f)
        return packed[:, :f], packed[:, f:]
    return rows_view(gate, f), rows_view(up, f)


def _fwd(g2: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Unchecked forward on ``[M, F]`` views: ``y [M, F]``."""
    y = torch.empty(g2.shape, dtype=g2.dtype, device=g2.device)
    _launch(_swiglu_fwd_kernel, g2, u2, y)
    return y


def _bwd(dy2: torch.Tensor, g2: torch.Tensor, u2: torch.Tensor, packed: bool):
    """Unchecked backward on ``[M, F]`` views: ``(dgate, dup)`` ``[M, F]``, or one ``[M, 2F]``
    gradient when ``packed``."""
    m, f = g2.shape
    if packed:
        grad = torch.empty((m, 2 * f), dtype=g2.dtype, device=g2.device)
        _launch(_swiglu_bwd_kernel, g2, u2, dy2, grad[:, :f], grad[:, f:])
        return grad
    dgate = torch.empty((m, f), dtype=g2.dtype, device=g2.device)
    dup = torch.empty((m, f), dtype=g2.dtype, device=g2.device)
    _launch(_swiglu_bwd_kernel, g2, u2, dy2, dgate, dup)
    return dgate, dup


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the forward: ``silu(gate) * up``, or of the halves of ``gate_up`` when ``up`` is None."""
    f = _check_inputs(gate, up)
    return _fwd(*_halves(gate, up, f)).view(*gate.shape[:-1], f)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None = None):
    """Launch the backward: ``(dgate, dup)``, or one ``[..., 2F]`` ``dgate_up`` in the packed form."""
    f = _check_inputs(gate, up)
    check_tensor("dy", dy)
    check_same_device(dy=dy, gate=gate)
    out_shape = (*gate.shape[:-1], f)
    if tuple(dy.shape) != out_shape:
        raise ValueError(f"dy must have shape {out_shape}, got {tuple(dy.shape)}")
    dgate, dup = swiglu_bwd_pair(dy, gate, up)
    return dgate if up is None else (dgate, dup)


def swiglu_bwd_pair(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None):
    """Unchecked :func:`swiglu_bwd` as a pair: ``(dgate, dup)``, or ``(dgate_up, None)`` in the packed form."""
    f = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    g2, u2 = _halves(gate, up, f)
    if up is None:
        return _bwd(rows_view(dy, f), g2, u2, packed=True).view(gate.shape), None
    dgate, dup = _bwd(rows_view(dy, f), g2, u2, packed=False)
    return dgate.view(gate.shape), dup.view(gate.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy, *, bwd=swiglu_bwd_pair):
    """``(dgate, dup)``, or ``(dgate_up, None)`` packed, by ``bwd``: the unchecked launcher eagerly (the
    forward checked the inputs), the backward op under torch.compile."""
    gate, up = ctx.saved_tensors
    dgate, dup = bwd(dy, gate, up)
    return dgate, (None if up is None else dup)


#: ``apply(gate, up)``, or ``apply(gate_up, None)`` for the packed form: the checked forward, and the unchecked
#: backward launcher through the pair the custom op's formula has too
SwiGLUFunction = formula_function("SwiGLUFunction", swiglu_fwd, _swiglu_setup, _swiglu_backward)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(gate: Tensor, up: Optional[Tensor]) -> Tensor:
    """:func:`kernels.swiglu.swiglu_fwd` (``up`` None: the packed ``[..., 2F]`` form)."""
    return swiglu_fwd(gate, up)


@fake(swiglu_fwd_op)
def _(gate, up):
    f = gate.shape[-1] // 2 if up is None else gate.shape[-1]
    return gate.new_empty((*gate.shape[:-1], f))


@define("tritonllm::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dy: Tensor, gate: Tensor, up: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(dgate, dup)``, or ``(dgate_up, absent)`` in the packed form: :func:`kernels.swiglu.swiglu_bwd`."""
    if up is None:
        return swiglu_bwd(dy, gate), absent(gate)
    return swiglu_bwd(dy, gate, up)


@fake(swiglu_bwd_op)
def _(dy, gate, up):
    return gate.new_empty(gate.shape), (absent(gate) if up is None else gate.new_empty(gate.shape))


register_formula(swiglu_fwd_op, _swiglu_setup, _swiglu_backward, bwd=swiglu_bwd_op)


@compiled("swiglu")
def _compiled_swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    return swiglu_fwd_op(gate, up)


@compilable
def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gating ``silu(gate) * up`` (``silu(g) = g * sigmoid(g)``), math in fp32.

    Two forms:
        ``swiglu(gate, up)``: ``gate`` and ``up`` of one shape ``[..., F]`` and dtype; returns ``[..., F]``.
        ``swiglu(gate_up)``: one ``[..., 2F]`` tensor, gate = ``[..., :F]``, up = ``[..., F:]``;
        returns ``[..., F]`` and its backward writes a single ``[..., 2F]`` gradient.

    Inputs are float32/float16/bfloat16; rows may be strided (last dim contiguous). The output has
    the inputs' dtype. The backward recomputes the sigmoid: only the inputs are saved.
    """
    if needs_grad(gate, up):
        return SwiGLUFunction.apply(gate, up)
    return swiglu_fwd(gate, up)  # nothing to differentiate: no autograd node
