"""Launchers shared by the flat elementwise ops (``relu2``, ``gelu_tanh``, ``softcap``): a forward kernel
``kernel(x, y, N, *scalars, BLOCK)`` and a backward kernel ``kernel(saved, dy, dx, N, *scalars, BLOCK)``
over one contiguous run of ``N`` elements, ``BLOCK`` per program; and the autograd pieces of a unary op
whose backward reads its input (``relu2``, ``gelu_tanh``)."""

from __future__ import annotations

import functools

import torch
import triton

from torch import Tensor

from ._interpreter import interpreting
from .checks import check_same_device, check_same_dtype, check_tensor
from .custom_op import compiled, define, fake, formula_function, register_formula

#: elements per program and warps on the GPU (memory-bound; not measured yet)
BLOCK, NUM_WARPS = 4096, 8
#: under the interpreter the cost is per program: large blocks
INTERP_BLOCK = 65536


def _launch(kernel, n: int, *args) -> None:
    if n:
        block = INTERP_BLOCK if interpreting() else BLOCK
        kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, num_warps=NUM_WARPS)


def elementwise_fwd(kernel, x: torch.Tensor, *scalars) -> torch.Tensor:
    """``kernel`` over a contiguous fp32/fp16/bf16 ``x`` into a new tensor like it."""
    check_tensor("x", x)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    y = torch.empty_like(x)
    _launch(kernel, x.numel(), x, y, x.numel(), *scalars)
    return y


def elementwise_bwd(kernel, saved: torch.Tensor, name: str, dy: torch.Tensor, *scalars) -> torch.Tensor:
    """``kernel`` over the forward's ``saved`` tensor (called ``name`` in errors) and ``dy`` (made
    contiguous) into a new gradient like ``saved``."""
    check_tensor("dy", dy)
    check_same_device(**{name: saved, "dy": dy})
    check_same_dtype(**{name: saved, "dy": dy})
    if dy.shape != saved.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but {name} has {tuple(saved.shape)}")
    dy = dy.contiguous()
    dx = torch.empty_like(saved)
    _launch(kernel, saved.numel(), saved, dy, dx, saved.numel(), *scalars)
    return dx


def save_input(ctx, inputs, output) -> None:
    """``setup_context`` of a unary op whose backward reads its input: saves ``inputs[0]``."""
    ctx.save_for_backward(inputs[0])


def input_backward(ctx, dy, *, bwd):
    """``dx = bwd(x, dy)`` from the saved input: ``bwd`` the op's backward launcher eagerly, its backward
    custom op under torch.compile (``custom_op.register_formula`` passes it)."""
    return bwd(ctx.saved_tensors[0], dy)


def unary_ops(name: str, fwd, bwd) -> tuple:
    """The custom ops ``tritonllm::<name>_fwd(x)`` and ``<name>_bwd(x, dy)`` of a unary op whose backward reads
    its input, over its launchers ``fwd`` and ``bwd``: fakes shaped like x, the autograd formula of
    :func:`save_input` and :func:`input_backward` (the pair of :func:`input_saving_function`), and the compiled
    functional ``<name>``. Returns ``(fwd_op, bwd_op)``."""
    def forward(x: Tensor) -> Tensor:
        return fwd(x)

    def backward(x: Tensor, dy: Tensor) -> Tensor:
        return bwd(x, dy)

    forward.__doc__, backward.__doc__ = f":func:`{fwd.__name__}`.", f":func:`{bwd.__name__}`."
    fwd_op = define(f"tritonllm::{name}_fwd")(forward)
    bwd_op = define(f"tritonllm::{name}_bwd")(backward)
    for op in (fwd_op, bwd_op):
        fake(op)(lambda x, *args: x.new_empty(x.shape))
    register_formula(fwd_op, save_input, input_backward, bwd=bwd_op)
    compiled(name)(lambda x: fwd_op(x))
    return fwd_op, bwd_op


def input_saving_function(name: str, fwd, bwd) -> type[torch.autograd.Function]:
    """The autograd Function ``name`` of a unary op: ``fwd(x)``, :func:`save_input`, and :func:`input_backward`
    with the launcher ``bwd``: the pair its custom op's formula is registered with (:func:`unary_ops`)."""
    return formula_function(name, fwd, save_input, functools.partial(input_backward, bwd=bwd))
