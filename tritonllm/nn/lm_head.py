"""The LM head's loss over ``tritonllm.kernels.linear_cross_entropy`` (logits never stored) and its
logits for inference (``linear``, then ``softcap``)."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.linear import linear
from tritonllm.kernels.linear_cross_entropy import linear_cross_entropy
from tritonllm.kernels.softcap import softcap


class LMHeadLoss(nn.Module):
    """Mean cross-entropy of the logits ``h @ weight.T`` against ``targets``, fused with the head GEMM.

    The head weight ``[V, d_model]`` is an argument, not a parameter: a tied model passes its
    embedding matrix, an untied one its own head. ``softcap`` c (None: off) caps the logits to
    ``c * tanh(logits / c)``; ``z_loss`` adds ``z_loss * mean(logsumexp^2)``; rows whose target is
    ``ignore_index`` count for nothing; ``fp8`` runs the loss's GEMMs on fp8 operands quantized per
    row (a GPU with fp8 tensor cores; see :func:`tritonllm.kernels.linear_cross_entropy`).

    ``forward(h [..., d_model], weight, targets [...]) -> (loss, z)``: the 0-d fp32 loss (z-loss
    term included) and the z-loss term alone. :meth:`logits` gives the capped logits for sampling.
    """

    def __init__(self, softcap: float | None = None, z_loss: float = 0.0, ignore_index: int = -100,
                 fp8: bool = False):
        super().__init__()
        self.softcap, self.z_loss, self.ignore_index, self.fp8 = softcap, z_loss, ignore_index, fp8

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        # fp8 passed only when on: the torch.compile route (the linear custom op, kernels/linear.py) has no fp8 argument
        fp8 = {"fp8": True} if self.fp8 else {}
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1),
                                    ignore_index=self.ignore_index, z_loss=self.z_loss, return_z_loss=True,
                                    softcap=self.softcap, **fp8)

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits of ``h [..., d_model]``, soft-capped when ``softcap`` is set."""
        logits = linear(h, weight)
        return logits if self.softcap is None else softcap(logits, self.softcap)

    def extra_repr(self) -> str:
        s = f"softcap={self.softcap}, z_loss={self.z_loss:g}, ignore_index={self.ignore_index}"
        return s + (", fp8=True" if self.fp8 else "")
