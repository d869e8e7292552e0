"""Dense transformer MLP over ``tritonllm.kernels.linear`` (SwiGLU in the GEMM's epilogue) and
``tritonllm.kernels.relu2``."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.relu2 import relu2
from tritonllm.nn.linear import Linear, LinearSwiGLU

ACTIVATIONS = ("swiglu", "relu2")


class MLP(nn.Module):
    """``[..., d_model] -> [..., d_model]`` through a hidden layer of width ``d_ff``.

    ``act="swiglu"``: ``w2(silu(x W_gate^T) * (x W_up^T))``, gate and up packed in one GEMM
    (``w13``, :class:`LinearSwiGLU` ``[2 d_ff, d_model]``, gate rows first). ``act="relu2"``:
    ``w2(relu(x W1^T)^2)`` (``w1``, :class:`Linear` ``[d_ff, d_model]``). The down projection
    ``w2`` (:class:`Linear` ``[d_model, d_ff]``) is initialised with ``out_std`` (None: ``init_std``).
    """

    def __init__(self, d_model: int, d_ff: int, act: str = "swiglu", init_std: float = 0.02,
                 out_std: float | None = None, device=None, dtype=None):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
        self.d_model, self.d_ff, self.act = d_model, d_ff, act
        kw = dict(init_std=init_std, device=device, dtype=dtype)
        if act == "swiglu":
            self.w13 = LinearSwiGLU(d_model, d_ff, **kw)
        else:
            self.w1 = Linear(d_model, d_ff, **kw)
        self.w2 = Linear(d_ff, d_model, **{**kw, "init_std": init_std if out_std is None else out_std})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w13(x) if self.act == "swiglu" else relu2(self.w1(x))
        return self.w2(h)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, act={self.act}"
