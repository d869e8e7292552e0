"""Mixture-of-Experts MLP over ``tritonllm.kernels.moe``: the model's MLP slot when ``n_experts > 0``."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from tritonllm.kernels.moe import ExpertLoRA, moe
from tritonllm.nn.linear import Linear, LinearSwiGLU


class MoEOutput(NamedTuple):
    """What :meth:`MoE.forward` returns.

    ``y``: the layer's output. ``aux_loss``: ``aux_loss_coef * aux + z_loss_coef * z``, 0-d fp32 and
    differentiable, to add to the training loss. ``stats``: detached 0-d tensors to log, read with no
    host synchronisation: ``moe_aux`` and ``moe_z`` (the unscaled router losses) and
    ``moe_max_load`` (the busiest expert's load over a balanced one's).
    """

    y: torch.Tensor
    aux_loss: torch.Tensor
    stats: dict[str, torch.Tensor]


class MoE(nn.Module):
    """Dropless top-k MoE of ``n_experts`` SwiGLU experts of width ``d_expert``, plus
    ``n_shared_experts`` always-on ones, ``[..., d_model] -> MoEOutput`` (``y [..., d_model]``).

    Routing (:func:`tritonllm.kernels.moe_router`): ``score`` ``"softmax"`` or ``"sigmoid"`` of the
    router logits, top ``top_k`` experts per token, their weights renormalised to sum to 1 when
    ``normalize``. The load-balancing loss is weighted by ``aux_loss_coef``, the router z-loss by
    ``z_loss_coef``.

    Parameters: ``router`` (:class:`Linear` ``[E, D]``), ``w13`` ``[E, 2F, D]`` (per expert the gate
    rows then the up rows), ``w2`` ``[E, D, F]``, and with shared experts ``shared_w13``
    (:class:`LinearSwiGLU`, width ``n_shared_experts * F``) and ``shared_w2`` (:class:`Linear`).
    Init: ``normal(0, init_std)``; the two down projections, which write into the residual stream,
    ``normal(0, out_std)`` (None: ``init_std``; the transformer passes ``init_std / sqrt(2 n_layers)``).
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, d_expert: int, n_shared_experts: int = 0, *,
                 score: str = "softmax", normalize: bool = True, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, init_std: float = 0.02, out_std: float | None = None,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        e, f, kw = n_experts, d_expert, dict(device=device, dtype=dtype)
        self.d_model, self.n_experts, self.top_k, self.d_expert = d_model, e, top_k, f
        self.n_shared_experts = n_shared_experts
        self.score, self.normalize = score, normalize
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        self.router = Linear(d_model, e, init_std=init_std, **kw)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d_model, **kw))
        self.w2 = nn.Parameter(torch.empty(e, d_model, f, **kw))
        fs = n_shared_experts * f
        self.shared_w13 = LinearSwiGLU(d_model, fs, init_std=init_std, **kw) if fs else None
        self.shared_w2 = Linear(fs, d_model, init_std=self.out_std, **kw) if fs else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w13, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2, mean=0.0, std=self.out_std)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        return self.route(x)

    def route(self, x: torch.Tensor, lora: ExpertLoRA | None = None) -> MoEOutput:
        """The layer on ``x``, the routed experts with the LoRA adapters ``lora`` when given. The shared expert
        runs through its modules (the products :func:`~tritonllm.kernels.moe.moe` would make of their
        weights), so that what is applied to them from outside (FP8, LoRA) takes effect."""
        x2 = x.reshape(-1, x.shape[-1])
        y, r = moe(x2, self.router.weight, self.w13, self.w2, self.top_k, self.score, self.normalize, lora=lora)
        if self.shared_w13 is not None and self.shared_w2 is not None:
            y = self.shared_w2(self.shared_w13(x2), residual=y)
        aux_loss = self.aux_loss_coef * r.aux_loss + self.z_loss_coef * r.z_loss
        stats = {"moe_aux": r.aux_loss.detach(), "moe_z": r.z_loss.detach(), "moe_max_load": r.max_load}
        return MoEOutput(y.view(x.shape), aux_loss, stats)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, d_expert={self.d_expert}, "
                f"n_shared_experts={self.n_shared_experts}, score={self.score}, normalize={self.normalize}, "
                f"aux_loss_coef={self.aux_loss_coef:g}, z_loss_coef={self.z_loss_coef:g}")
