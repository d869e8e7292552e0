"""A dropless Mixture-of-Experts SwiGLU layer composed from tritonllm's Triton kernels.

For tokens ``x [T, D]``, ``E`` experts with ``w13 [E, 2F, D]`` (gate rows then up rows) and
``w2 [E, D, F]``::

    logits  = x @ W_router^T                                  linear             [T, E]
    routing = top-k experts, weights, aux / z losses           moe_router
    plan    = assignments grouped by expert                     moe_sort
    xs      = x[token of each sorted row]                       moe_gather         [T k, D]
    h       = silu(xs @ W_gate[e]^T) * (xs @ W_up[e]^T)         grouped_linear_swiglu [T k, F]
    o       = h @ W2[e]^T                                       grouped_linear     [T k, D]
    y[t]    = sum_j w[t, j] o[positions[t, j]]                  moe_combine        [T, D]
    y      += w2_s(silu(x W_gs^T) * (x W_us^T))                 shared expert (optional): linear_swiglu,
                                                               then linear with y as the residual epilogue

Every step's backward is its own Triton kernel (see each module); gradients reach ``x``, the
router weight (through the routing weights and both losses) and all expert weights.
"""

from __future__ import annotations

import torch

from .grouped_linear import grouped_linear, grouped_linear_swiglu
from .linear import linear, linear_swiglu
from .moe_permute import moe_combine, moe_gather, moe_sort
from .moe_router import MoERouting, moe_router


def moe(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        score: str = "softmax", normalize: bool = True, shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None) -> tuple[torch.Tensor, MoERouting]:
    """Dropless top-k MoE SwiGLU layer.

    Args:
        x: ``[T, D]`` tokens.
        router_weight: ``[E, D]``.
        w13: ``[E, 2F, D]`` per-expert gate (rows ``0:F``) and up (rows ``F:2F``) projections.
        w2: ``[E, D, F]`` per-expert down projections.
        top_k, score, normalize: as in :func:`moe_router`.
        shared_w13, shared_w2: optional always-on expert ``[2Fs, D]`` and ``[D, Fs]``.

    Returns:
        ``(y [T, D], routing)`` where ``routing`` is the :class:`MoERouting` of the layer (its
        ``aux_loss`` and ``z_loss`` are differentiable, to be added to the training loss).
    """
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 must be given together (the shared expert)")
    routing = moe_router(linear(x, router_weight), top_k, score, normalize)
    y = moe_experts(x, routing.indices, routing.weights, w13, w2)
    if shared_w13 is not None:
        y = linear(linear_swiglu(x, shared_w13), shared_w2, residual=y)
    return y, routing


def moe_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
    """The routed experts of :func:`moe` for a given routing: ``y[t] = sum_j weights[t, j]
    W2[e] (silu(W_gate[e] x[t]) * (W_up[e] x[t]))`` with ``e = indices[t, j]``.

    ``x [T, D]``, ``indices [T, k]`` (int), ``weights [T, k]`` (differentiable), ``w13 [E, 2F, D]``,
    ``w2 [E, D, F]`` (read in place: no copy of the expert weights). Returns ``y [T, D]``.
    """
    plan = moe_sort(indices, w13.shape[0])
    h = grouped_linear_swiglu(moe_gather(x, plan), w13, plan.expert_offsets)
    return moe_combine(grouped_linear(h, w2, plan.expert_offsets), weights, plan)
