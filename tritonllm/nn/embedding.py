"""Token embedding over ``tritonllm.kernels.embedding``."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.embedding import embedding


class Embedding(nn.Module):
    """``weight[ids]``: ids of any shape ``[...]`` give ``[..., embedding_dim]``.

    Initialised from ``normal(0, init_std)``; the ``padding_idx`` row (if any) is zeroed and gets
    no gradient. ``validate=False`` skips the host-side id range check (one device sync per call):
    for callers whose ids are already known to be in range, like the training loop, whose data
    loader rejects out-of-vocabulary batches.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 init_std: float = 0.02, validate: bool = True, device=None, dtype=None):
        super().__init__()
        self.validate = validate
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.init_std = padding_idx, init_std
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, padding_idx=self.padding_idx, validate=self.validate)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, init_std={self.init_std:.3g}"
        return s if self.padding_idx is None else s + f", padding_idx={self.padding_idx}"
