"""FP8 training of a model's linear layers (``trainer.precision=fp8``), applied from outside the model.

:func:`convert_to_fp8` turns every :class:`~tritonllm.nn.linear.Linear` and
:class:`~tritonllm.nn.linear.LinearSwiGLU` of a model (attention qkv and output projections, the dense
MLPs and the MoE shared experts) into their FP8 forms in place: same parameters, same state dict, the
forward and both backward GEMMs on fp8 operands (``tritonllm.kernels.fp8_linear``). The weights stay
in the model's dtype (AdamW's fp32 master weights are unchanged) and nothing fp8 is saved in a
checkpoint. A LoRA layer's frozen weight computes in FP8 too, its adapters in the model's dtype. The LM head
and the embedding stay as they are (``model.lm_head_fp8`` puts the head's GEMMs in fp8), and so do the routed
MoE experts (grouped GEMM).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tritonllm.errors import ConfigError
from tritonllm.kernels.fp8_linear import E4M3, E5M2, fp8_linear, fp8_linear_swiglu, fp8_supported
from tritonllm.nn.linear import Linear, LinearSwiGLU
from tritonllm.nn.lora import LoRALinear

log = logging.getLogger(__name__)

#: training precisions of the linear layers (``trainer.precision``)
PRECISIONS = ("bf16", "fp8")
#: fp8 formats of the gradients (``trainer.fp8_grad_dtype``)
GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


class Fp8Linear(Linear):
    """:class:`Linear` with its GEMMs in FP8 (:func:`~tritonllm.kernels.fp8_linear.fp8_linear`)."""

    grad_dtype: torch.dtype = E4M3

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, residual, grad_dtype=self.grad_dtype)


class Fp8LinearSwiGLU(LinearSwiGLU):
    """:class:`LinearSwiGLU` with its GEMMs in FP8 (:func:`~tritonllm.kernels.fp8_linear.fp8_linear_swiglu`)."""

    grad_dtype: torch.dtype = E4M3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear_swiglu(x, self.weight, grad_dtype=self.grad_dtype)


def convert_to_fp8(model: nn.Module, grad_dtype: torch.dtype = E4M3, skip: tuple[str, ...] = ("lm_head", "router")) -> int:
    """Make every Linear and LinearSwiGLU of ``model`` (but those whose name is in ``skip``: the LM head and the
    MoE routers, whose top-k choice rounding would move, by default) compute in FP8,
    gradients quantized to ``grad_dtype``, and every LoRA layer's frozen product (its gradients in e4m3);
    returns how many were converted. Raises ValueError on a device without fp8 tensor cores."""
    device = next(model.parameters()).device
    if not fp8_supported(device):
        raise ValueError(f"fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
                         f"Blackwell), or Triton's interpreter on the CPU; the model is on {device}")
    converted = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in skip:
            continue
        if isinstance(module, LoRALinear):
            module.fp8 = True
            converted += 1
            continue
        kind = {Linear: Fp8Linear, LinearSwiGLU: Fp8LinearSwiGLU}.get(type(module))
        if kind is not None:
            module.__class__ = kind
            module.grad_dtype = grad_dtype
            converted += 1
    log.info("precision fp8: %d linear layers compute in fp8 (e4m3 x and W, %s gradients, rowwise scales)",
             converted, str(grad_dtype).replace("torch.float8_", ""))
    return converted


def apply_precision(model: nn.Module, precision: str, grad_dtype: str = "e4m3") -> None:
    """``trainer.precision``: ``bf16`` leaves the model as built, ``fp8`` is :func:`convert_to_fp8` with the
    gradients in ``grad_dtype`` (``trainer.fp8_grad_dtype``: e4m3 or e5m2)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision must be one of {PRECISIONS}, got {precision!r}")
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"trainer.fp8_grad_dtype must be one of {tuple(GRAD_DTYPES)}, got {grad_dtype!r}")
    if precision == "fp8":
        try:
            convert_to_fp8(model, GRAD_DTYPES[grad_dtype])
        except ValueError as e:
            raise ConfigError(f"trainer.precision=fp8: {e}") from None
