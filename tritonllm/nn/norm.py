"""RMSNorm over ``tritonllm.kernels.rms_norm``, with the optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (weight initialised to ones).

    ``forward(x)`` returns ``y``; ``forward(x, residual=r)`` normalises ``s = x + r`` and returns
    ``(y, s)``, the add fused into the kernel (the pre-norm transformer's residual stream).
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps:g}"
