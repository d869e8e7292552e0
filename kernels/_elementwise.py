"""Launchers shared by the flat elementwise ops (``relu2``, ``gelu_tanh``, ``softcap``): a forward kernel
``kernel(x, y, N, *scalars, BLOCK)`` and a backward kernel ``kernel(saved, dy, dx, N, *scalars, BLOCK)``
over one contiguous run of ``N`` elements, ``BLOCK`` per program; and all a unary op whose backward reads
its input (``relu2``, ``gelu_tanh``) builds on its two kernels, :func:`unary_op`."""

from __future__ import annotations

import functools

import torch
import triton

from torch import Tensor

from ._interpreter import interpreting
from .checks import check_same_device, check_same_dtype, check_tensor, needs_grad
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


def unary_op(name: str, fwd_kernel, bwd_kernel) -> tuple:
    """A unary op whose backward reads its input, built on its kernels ``fwd_kernel(x, y, N, BLOCK)`` and
    ``bwd_kernel(x, dy, dx, N, BLOCK)``: the checked launchers ``<name>_fwd(x)`` (:func:`elementwise_fwd`) and
    ``<name>_bwd(x, dy)`` (:func:`elementwise_bwd`); the custom ops ``tritonllm::<name>_fwd(x)`` and
    ``<name>_bwd(x, dy)`` with fakes shaped like x, the autograd formula of :func:`save_input` and
    :func:`input_backward`, and the compiled functional ``<name>``; and the eager functional, which runs the
    autograd Function ``<Name>Function`` of the same pair (:func:`~kernels.custom_op.formula_function`) when
    x requires grad, else the forward launcher. Returns ``(fwd, bwd, functional)``."""
    def fwd(x: Tensor) -> Tensor:
        return elementwise_fwd(fwd_kernel, x)

    def bwd(x: Tensor, dy: Tensor) -> Tensor:
        return elementwise_bwd(bwd_kernel, x, "x", dy)

    for launcher, pass_ in ((fwd, "fwd"), (bwd, "bwd")):
        launcher.__name__ = launcher.__qualname__ = f"{name}_{pass_}"
    fwd.__doc__ = f"``{name}`` of a contiguous fp32/fp16/bf16 tensor ``x``, in its dtype."
    bwd.__doc__ = f"The input's gradient of ``{name}`` from the forward's input ``x`` and ``dy`` (made contiguous)."
    fwd_op = define(f"tritonllm::{name}_fwd")(fwd)
    bwd_op = define(f"tritonllm::{name}_bwd")(bwd)
    for op in (fwd_op, bwd_op):
        fake(op)(lambda x, *args: x.new_empty(x.shape))
    register_formula(fwd_op, save_input, input_backward, bwd=bwd_op)
    compiled(name)(lambda x: fwd_op(x))
    camel = "".join(word.capitalize() for word in name.split("_"))
    function = formula_function(f"{camel}Function", fwd, save_input, functools.partial(input_backward, bwd=bwd))

    def functional(x: Tensor) -> Tensor:
        return function.apply(x) if needs_grad(x) else fwd(x)
    return fwd, bwd, functional
