"""Plain-PyTorch references of tritonllm's kernels: the float64 yardsticks of the tests and benchmarks.

Each function computes the op's formula with PyTorch ops in the dtype of its inputs: called on float64
tensors it is the float64 reference, called on the kernel's own inputs it is PyTorch's result in that
dtype (the tolerance rule compares the kernel's error with PyTorch's own). Differentiable where the
op is. Names and arguments follow the functional of ``tritonllm.kernels`` each one checks; no kernel
is used here.

Lives beside :mod:`tritonllm.bench.reference_model` (the whole Transformer in plain PyTorch, built
from these ops), inside the installed package, so that the tests and the benchmarks on a machine
without the tests folder read one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding(ids, weight, padding_idx=None):
    """``weight[ids]`` (``F.embedding``; the ``padding_idx`` row gets no gradient)."""
    return F.embedding(ids.long(), weight, padding_idx=padding_idx)


def linear(x, weight, bias=None, residual=None):
    """``x @ weight.T (+ bias) (+ residual)``."""
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def swiglu(gate, up=None):
    """``silu(gate) * up``; with one tensor, the packed ``[..., 2F]`` input (gate columns first)."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_swiglu(x, w13):
    """``swiglu`` of ``x @ w13.T`` (``w13`` ``[2F, K]``: gate rows then up rows)."""
    return swiglu(F.linear(x, w13))


def relu2(x):
    """Squared ReLU ``relu(x)^2``."""
    return F.relu(x).square()


def gelu_tanh(x):
    """GELU with the tanh approximation, ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return F.gelu(x, approximate="tanh")


def softcap(x, cap):
    """``cap * tanh(x / cap)``."""
    return cap * torch.tanh(x / cap)


def weighted_add(x, y, weight):
    """``weight[0] x + weight[1] y`` (two weights) or ``x + weight[0] y`` (one)."""
    return weight[0] * x + weight[1] * y if weight.numel() == 2 else x + weight[0] * y


def rms_norm(x, weight, eps=1e-6, residual=None):
    """``h / sqrt(mean(h^2) + eps) * weight`` over the last dimension with ``h = x (+ residual)``:
    ``y``, or ``(y, h)`` when ``residual`` is given (as the kernel returns the sum)."""
    h = x if residual is None else x + residual
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight
    return y if residual is None else (y, h)


def rope(x, cos, sin, position_offset=0):
    """Half-split RoPE of ``x [B, T, H, D]``: the pairs ``(x[..., i], x[..., i + D/2])`` rotated by the
    angle of position ``position_offset + t`` (rows of ``cos, sin [rows, D/2]``, cast to x's dtype)."""
    T, half = x.shape[1], x.shape[-1] // 2
    c = cos[position_offset:position_offset + T, None, :].to(x.dtype)
    s = sin[position_offset:position_offset + T, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def attention(q, k, v, causal=True, window=None, softmax_scale=None, return_lse=False, doc_ids=None):
    """Softmax attention of ``q [B, T, Hq, D]`` over ``k, v [B, S, Hkv, D]`` by an explicit masked
    softmax: GQA by repeating each KV head for its ``Hq / Hkv`` query heads; the causal and window
    masks bottom-right aligned (query t sits at key position ``t + S - T`` and sees keys
    ``j <= t + S - T``, and with ``window`` ``j > t + S - T - window``); with ``doc_ids [B, T]``
    (T == S, packed documents) only keys of the query's own document. Rows that see no key give
    0 and lse ``-inf``, like the kernel. With ``return_lse``: ``(out, lse [B, Hq, T])``."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    i = torch.arange(T, device=q.device)[:, None] + (S - T)
    j = torch.arange(S, device=q.device)[None, :]
    visible = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= j > i - window
    if doc_ids is not None:
        visible = visible & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None].to(q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhts,bshd->bthd", p / denom.clamp_min(torch.finfo(q.dtype).tiny), v)
    return (out, (m + denom.log()).squeeze(-1)) if return_lse else out


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
                  return_z_loss=False):
    """``F.cross_entropy`` plus the z-loss term ``z_loss * logsumexp^2`` per row whose target is not
    ``ignore_index``, reduced by ``mean`` (over those rows), ``sum`` or ``none`` (target's shape).
    With ``return_z_loss``: ``(loss, z-loss term)`` reduced alike."""
    x = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1).long()
    valid = t != ignore_index
    z = torch.where(valid, z_loss * torch.logsumexp(x, -1) ** 2, 0.0)
    rows = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none") + z
    if reduction == "none":
        loss, z = rows.view(target.shape), z.view(target.shape)
    else:
        n = valid.sum().clamp(min=1) if reduction == "mean" else 1
        loss, z = rows.sum() / n, z.sum() / n
    return (loss, z) if return_z_loss else loss


def linear_cross_entropy(x, weight, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
                         return_z_loss=False, softcap=None):
    """:func:`cross_entropy` of the LM head's logits ``x @ weight.T``, taken in fp32 (or float64) as the
    fused kernel does, capped to ``softcap * tanh(logits / softcap)`` when ``softcap`` is given."""
    logits = F.linear(x, weight)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, reduction, return_z_loss)


def moe_router(logits, indices, score="softmax", normalize=True):
    """``(weights [T, k], aux, z)`` of the router for the given expert choices ``indices [T, k]``: the
    scores (softmax, or sigmoid) of the chosen experts, renormalised to sum 1 when ``normalize``; the
    load-balancing loss ``E * sum_e f_e * mean_t q_te`` (``f_e`` the fraction of assignments to e, q the
    softmax or the normalised sigmoid); the z-loss ``mean(logsumexp^2)``."""
    T, E = logits.shape
    k = indices.shape[1]
    p = torch.softmax(logits, -1)
    s = p if score == "softmax" else torch.sigmoid(logits)
    q = p if score == "softmax" else s / s.sum(-1, keepdim=True)
    w = s.gather(1, indices.long())
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    f = torch.bincount(indices.long().flatten(), minlength=E).to(logits.dtype) / (T * k)
    aux = E * (f * q.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return w, aux, z


def grouped_linear(x, w, offsets, swiglu_epilogue=False):
    """Rows ``offsets[e]:offsets[e+1]`` of ``x`` times ``w[e].T`` for each expert e (then
    :func:`swiglu` of each product with ``swiglu_epilogue``), concatenated."""
    outs = []
    for e in range(w.shape[0]):
        y = x[offsets[e]:offsets[e + 1]] @ w[e].T
        outs.append(swiglu(y) if swiglu_epilogue else y)
    return torch.cat(outs)


def moe(x, router_weight, w13, w2, indices, score="softmax", normalize=True, shared=None):
    """``(y, aux, z)`` of the MoE SwiGLU layer for tokens ``x [T, D]`` and the given expert choices
    ``indices [T, k]``: a loop over experts (``index_add``), plus the shared expert ``(w13, w2)``."""
    w, aux, z = moe_router(x @ router_weight.T, indices, score, normalize)
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(indices.long() == e)
        y = y.index_add(0, tok, swiglu(x[tok] @ w13[e].T) @ w2[e].T * w[tok, slot, None].to(x.dtype))
    if shared is not None:
        y = y + swiglu(x @ shared[0].T) @ shared[1].T
    return y, aux, z
