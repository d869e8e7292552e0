"""Linear layers over ``tritonllm.kernels.linear`` and ``tritonllm.kernels.linear_swiglu``.

Weights are ``[out_features, in_features]`` like ``torch.nn.Linear``, initialised from
``normal(0, init_std)`` (the bias, if any, from zeros).
"""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.linear import linear, linear_swiglu


class Linear(nn.Module):
    """``y = x @ W.T (+ bias) (+ residual)``; the residual add is the GEMM's epilogue."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.init_std = in_features, out_features, init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, residual=residual)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, init_std={self.init_std:.3g}")


class LinearSwiGLU(nn.Module):
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` as one GEMM over the packed weight ``[2 * hidden, in]``
    (gate rows first, then up rows), with the SwiGLU in the epilogue."""

    def __init__(self, in_features: int, hidden_features: int, init_std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.in_features, self.hidden_features, self.init_std = in_features, hidden_features, init_std
        self.weight = nn.Parameter(torch.empty(2 * hidden_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_swiglu(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, hidden_features={self.hidden_features}, init_std={self.init_std:.3g}"
