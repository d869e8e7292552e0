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

LoRA on the routed experts (:class:`ExpertLoRA`, ``lora=``): per expert ``W13_e + s B13_e A13_e`` and
``W2_e + s B2_e A2_e`` without building either sum: the low-rank terms are two more grouped GEMMs on the
same grouped rows, added by ``weighted_add`` (so the SwiGLU runs on its own, after the sum)::

    gu = xs @ W13[e]^T + s (xs @ A13[e]^T) @ B13[e]^T               [T k, 2F]
    h  = silu(gu[:, :F]) * gu[:, F:]                                swiglu
    o  = h @ W2[e]^T + s (h @ A2[e]^T) @ B2[e]^T                     [T k, D]

with A13 ``[E, r, D]``, B13 ``[E, 2F, r]``, A2 ``[E, r, F]``, B2 ``[E, D, r]`` (PEFT's LoRA on the
fused ``gate_up_proj`` / ``down_proj`` expert parameters, ``target_parameters``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .grouped_linear import grouped_linear, grouped_linear_swiglu
from .linear import linear, linear_swiglu
from .moe_permute import moe_combine, moe_gather, moe_sort
from .moe_router import MoERouting, moe_router
from .residual_mix import weighted_add
from .swiglu import swiglu


class ExpertLoRA(NamedTuple):
    """LoRA adapters of the routed experts (module docstring): ``a13 [E, r, D]``, ``b13 [E, 2F, r]``,
    ``a2 [E, r, F]``, ``b2 [E, D, r]`` and ``scale``, a 1-element tensor on their device (alpha / r)."""

    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    scale: torch.Tensor


def _check_lora(lora: ExpertLoRA, w13: torch.Tensor, w2: torch.Tensor) -> None:
    E, F2, D = w13.shape
    r = lora.a13.shape[1] if lora.a13.dim() == 3 else -1
    want = {"a13": (E, r, D), "b13": (E, F2, r), "a2": (E, r, F2 // 2), "b2": (E, D, r)}
    for name, shape in want.items():
        got = tuple(getattr(lora, name).shape)
        if got != shape:
            raise ValueError(f"lora.{name} must be {list(shape)} for w13 {list(w13.shape)} and w2 "
                             f"{list(w2.shape)} (rank {r}), got {list(got)}")
    if lora.scale.numel() != 1:
        raise ValueError(f"lora.scale must hold one element, got {lora.scale.numel()}")


def _low_rank(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
              offsets: torch.Tensor) -> torch.Tensor:
    """``x @ W[e]^T + scale (x @ A[e]^T) @ B[e]^T`` per expert's rows."""
    return weighted_add(grouped_linear(x, w, offsets), grouped_linear(grouped_linear(x, a, offsets), b, offsets),
                        scale)


def moe(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        score: str = "softmax", normalize: bool = True, shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None, lora: ExpertLoRA | None = None) -> tuple[torch.Tensor, MoERouting]:
    """Dropless top-k MoE SwiGLU layer.

    Args:
        x: ``[T, D]`` tokens.
        router_weight: ``[E, D]``.
        w13: ``[E, 2F, D]`` per-expert gate (rows ``0:F``) and up (rows ``F:2F``) projections.
        w2: ``[E, D, F]`` per-expert down projections.
        top_k, score, normalize: as in :func:`moe_router`.
        shared_w13, shared_w2: optional always-on expert ``[2Fs, D]`` and ``[D, Fs]``.
        lora: optional LoRA adapters of the routed experts (:class:`ExpertLoRA`).

    Returns:
        ``(y [T, D], routing)`` where ``routing`` is the :class:`MoERouting` of the layer (its
        ``aux_loss`` and ``z_loss`` are differentiable, to be added to the training loss).
    """
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 must be given together (the shared expert)")
    routing = moe_router(linear(x, router_weight), top_k, score, normalize)
    y = moe_experts(x, routing.indices, routing.weights, w13, w2, lora)
    if shared_w13 is not None:
        y = linear(linear_swiglu(x, shared_w13), shared_w2, residual=y)
    return y, routing


def moe_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, lora: ExpertLoRA | None = None) -> torch.Tensor:
    """The routed experts of :func:`moe` for a given routing: ``y[t] = sum_j weights[t, j]
    W2[e] (silu(W_gate[e] x[t]) * (W_up[e] x[t]))`` with ``e = indices[t, j]``.

    ``x [T, D]``, ``indices [T, k]`` (int), ``weights [T, k]`` (differentiable), ``w13 [E, 2F, D]``,
    ``w2 [E, D, F]`` (read in place: no copy of the expert weights), ``lora`` the experts' adapters
    (:class:`ExpertLoRA`; the base products then run apart from the SwiGLU). Returns ``y [T, D]``.
    """
    plan = moe_sort(indices, w13.shape[0])
    xs, offsets = moe_gather(x, plan), plan.expert_offsets
    if lora is None:
        return moe_combine(grouped_linear(grouped_linear_swiglu(xs, w13, offsets), w2, offsets), weights, plan)
    _check_lora(lora, w13, w2)
    h = swiglu(_low_rank(xs, w13, lora.a13, lora.b13, lora.scale, offsets))
    return moe_combine(_low_rank(h, w2, lora.a2, lora.b2, lora.scale, offsets), weights, plan)
