"""Mixture-of-Experts MLP over ``tritonllm.kernels.moe``: the model's MLP slot when ``n_experts > 0``."""

from __future__ import annotations

import math

import torch
from torch import nn

from tritonllm.kernels.moe import moe
from tritonllm.nn.linear import Linear, LinearSwiGLU


class MoE(nn.Module):
    """Dropless top-k MoE of SwiGLU experts, plus ``n_shared_experts`` always-on ones.

    Parameters: ``router`` (:class:`Linear` ``[E, D]``), ``w13`` ``[E, 2F, D]`` (per expert the gate
    rows then the up rows), ``w2`` ``[E, D, F]``, and with shared experts ``shared_w13``
    (:class:`LinearSwiGLU`, width ``n_shared_experts * F``) and ``shared_w2`` (:class:`Linear`).
    Init: ``normal(0, init_std)``; the two down projections, which write into the residual
    stream, ``normal(0, init_std / sqrt(2 n_layers))`` like the dense MLP.

    ``forward(x [..., D]) -> [..., D]`` sets ``self.aux_loss = moe_aux_loss_coef * aux +
    moe_z_loss_coef * z`` (0-d fp32, differentiable) and ``self.stats`` (detached 0-d tensors, no
    host synchronisation: ``moe_aux``, ``moe_z`` and ``moe_max_load``, the busiest expert's load
    over a balanced one's).
    """

    def __init__(self, cfg):
        super().__init__()
        d, e, f = cfg.d_model, cfg.n_experts, cfg.d_expert
        self.n_experts, self.top_k, self.d_expert = e, cfg.moe_top_k, f
        self.score, self.normalize = cfg.moe_score, cfg.moe_normalize
        self.aux_loss_coef, self.z_loss_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.init_std, self.out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.router = Linear(d, e, init_std=cfg.init_std)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        fs = cfg.n_shared_experts * f
        self.shared_w13 = LinearSwiGLU(d, fs, init_std=cfg.init_std) if fs else None
        self.shared_w2 = Linear(fs, d, init_std=self.out_std) if fs else None
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w13, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2, mean=0.0, std=self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = (self.shared_w13.weight, self.shared_w2.weight) if self.shared_w13 is not None else (None, None)
        y, r = moe(x.reshape(-1, x.shape[-1]), self.router.weight, self.w13, self.w2, self.top_k, self.score,
                   self.normalize, *shared)
        self.aux_loss = self.aux_loss_coef * r.aux_loss + self.z_loss_coef * r.z_loss
        self.stats = {"moe_aux": r.aux_loss.detach(), "moe_z": r.z_loss.detach(), "moe_max_load": r.max_load}
        return y.view(x.shape)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, d_expert={self.d_expert}, score={self.score}, "
                f"normalize={self.normalize}, aux_loss_coef={self.aux_loss_coef:g}, z_loss_coef={self.z_loss_coef:g}")
