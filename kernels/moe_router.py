"""Mixture-of-Experts router: top-k expert choice, routing weights and the two router losses.

For one token with router logits ``l`` (``E`` experts) and ``k = top_k``:

Forward::

    p      = softmax(l)                                     # router probabilities
    s      = p                  (score="softmax")
           = sigmoid(l)         (score="sigmoid")
    idx    = the k experts of largest l (= largest s), in decreasing order, ties to the lower index
    w_j    = s[idx_j] / sum_m s[idx_m]    (normalize=True)  # Mixtral / DeepSeek-V3
           = s[idx_j]                     (normalize=False) # Switch

Over the ``T`` tokens, with ``c_i`` the number of (token, slot) assignments to expert ``i``::

    f_i      = c_i / (T k)                  fraction of assignments routed to expert i (no gradient)
    P_i      = mean_t q[t, i]               q = p (softmax), or s / sum(s) (sigmoid: DeepSeek-V3)
    aux_loss = E * sum_i f_i P_i            Switch / Mixtral load balancing, 1.0 when balanced
    z_loss   = mean_t logsumexp(l_t)^2      ST-MoE router z-loss
    max_load = max_i c_i / (T k / E)        the busiest expert's load relative to a balanced one

Backward (``dw`` the gradient of the weights, ``da``/``dz`` those of the two losses), per token::

    g_s[i]  = sum_j [i == idx_j] (dw_j - sum_m dw_m w_m) / S   (normalize, S = sum_m s[idx_m])
            = sum_j [i == idx_j] dw_j                          (no normalize)
    g_q[i]  = da * E f_i / T
    softmax:  g_p = g_s + g_q
    sigmoid:  g_s += (g_q - sum(g_q q)) / sum(s);  dl = g_s * s (1 - s)
    dl     += p * (g_p - sum(g_p p))      (softmax; g_p = 0 for sigmoid)
    dl     += dz * (2 / T) * logsumexp(l) * p

All arithmetic is in fp32; the routing weights are returned in fp32 whatever the logits' dtype
(they multiply expert outputs in the combine, where their precision matters). The loss sums are
per-program partials reduced by one program in a fixed order: deterministic.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_tensor, rows_view
from .launch import next_pow2
from .custom_op import compilable, compiled, define, fake, register_formula

SCORES = ("softmax", "sigmoid")


@triton.jit
def _router_scores(logits_ptr, stride_lt, pid, T, E, SIGMOID: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Load a [BLOCK_T, BLOCK_E] tile of logits; return rows, cols, masks, l, p, lse, s, q."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :]
    l = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    l = tl.where(cmask[None, :], l, float("-inf"))
    m = tl.max(l, axis=1)
    ex = tl.exp(l - m[:, None])
    den = tl.sum(ex, axis=1)
    p = ex / den[:, None]
    lse = m + tl.log(den)
    if SIGMOID:
        s = tl.sigmoid(l)
        q = s / tl.sum(s, axis=1)[:, None]
    else:
        s = p
        q = p
    return rows, cols, rmask, cmask, l, p, lse, s, q


@triton.jit
def _moe_router_fwd_kernel(
    logits_ptr,   # [T, E] router logits, last dim contiguous
    stride_lt,    # row stride of logits (elements)
    idx_ptr,      # [T, K] int32 out: chosen experts, contiguous
    w_ptr,        # [T, K] fp32 out: routing weights, contiguous
    pcount_ptr,   # [G, E] int32 out: per-program assignment counts per expert
    pprob_ptr,    # [G, E] fp32 out: per-program sums of q over the program's tokens
    pz_ptr,       # [G] fp32 out: per-program sums of logsumexp^2
    T, E,
    K: tl.constexpr, K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols, rmask, cmask, l, p, lse, s, q = _router_scores(
        logits_ptr, stride_lt, pid, T, E, SIGMOID, BLOCK_T, BLOCK_E)
    kcols = tl.arange(0, K_PAD)
    work = l
    chosen = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    top_idx = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    top_s = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(K):
        mx = tl.max(work, axis=1)
        sel = tl.min(tl.where(work == mx[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == sel[:, None]
        top_idx = tl.where(kcols[None, :] == j, sel[:, None], top_idx)
        top_s = tl.where(kcols[None, :] == j, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], top_s)
        chosen += hit.to(tl.int32)
        work = tl.where(hit, float("-inf"), work)
    if NORMALIZE:
        top_s = top_s / tl.sum(top_s, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    omask = rmask[:, None] & (kcols[None, :] < K)
    tl.store(idx_ptr + out, top_idx, mask=omask)
    tl.store(w_ptr + out, top_s, mask=omask)

    chosen = tl.where(rmask[:, None], chosen, 0)
    gbase = pid.to(tl.int64) * E
    tl.store(pcount_ptr + gbase + cols, tl.sum(chosen, axis=0), mask=cmask)
    tl.store(pprob_ptr + gbase + cols, tl.sum(tl.where(rmask[:, None] & cmask[None, :], q, 0.0), axis=0),
             mask=cmask)
    tl.store(pz_ptr + pid, tl.sum(tl.where(rmask, lse * lse, 0.0), axis=0))


@triton.jit
def _moe_router_reduce_kernel(
    pcount_ptr,   # [G, E] int32 per-program counts
    pprob_ptr,    # [G, E] fp32 per-program probability sums
    pz_ptr,       # [G] fp32 per-program logsumexp^2 sums
    counts_ptr,   # [E] int32 out: assignments per expert
    aux_ptr,      # [] fp32 out: load-balancing loss
    z_ptr,        # [] fp32 out: router z-loss
    maxload_ptr,  # [] fp32 out: max_i c_i / (T k / E)
    G, T, E,
    K: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    probs = tl.zeros([BLOCK_E], dtype=tl.float32)
    zs = tl.zeros([BLOCK_G], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        gmask = g < G
        m = gmask[:, None] & cmask[None, :]
        off = g.to(tl.int64)[:, None] * E + cols[None, :]
        counts += tl.sum(tl.load(pcount_ptr + off, mask=m, other=0), axis=0)
        probs += tl.sum(tl.load(pprob_ptr + off, mask=m, other=0.0), axis=0)
        zs += tl.load(pz_ptr + g, mask=gmask, other=0.0)
    tl.store(counts_ptr + cols, counts, mask=cmask)
    assignments = T * K
    f = counts.to(tl.float32) / assignments
    tl.store(aux_ptr, E * tl.sum(f * probs, axis=0) / T)
    tl.store(z_ptr, tl.sum(zs, axis=0) / T)
    tl.store(maxload_ptr, tl.max(counts, axis=0).to(tl.float32) * E / assignments)


@triton.jit
def _moe_router_bwd_kernel(
    logits_ptr,   # [T, E] router logits, last dim contiguous
    stride_lt,    # row stride of logits
    idx_ptr,      # [T, K] int32 chosen experts
    dw_ptr,       # [T, K] fp32 gradient of the routing weights (HAS_DW)
    counts_ptr,   # [E] int32 assignments per expert (HAS_DAUX)
    daux_ptr,     # [] gradient of aux_loss (HAS_DAUX)
    dz_ptr,       # [] gradient of z_loss (HAS_DZ)
    dl_ptr,       # [T, E] out: gradient of the logits, contiguous
    T, E,
    K: tl.constexpr,
    SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_DW: tl.constexpr, HAS_DAUX: tl.constexpr, HAS_DZ: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols, rmask, cmask, l, p, lse, s, q = _router_scores(
        logits_ptr, stride_lt, pid, T, E, SIGMOID, BLOCK_T, BLOCK_E)
    g_s = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DW:
        chosen = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        rk = rows.to(tl.int64) * K
        for j in tl.static_range(K):
            e = tl.load(idx_ptr + rk + j, mask=rmask, other=-1)
            dwj = tl.load(dw_ptr + rk + j, mask=rmask, other=0.0).to(tl.float32)
            hit = cols[None, :] == e[:, None]
            chosen = chosen | hit
            g_s += tl.where(hit, dwj[:, None], 0.0)
        if NORMALIZE:
            ssel = tl.where(rmask, tl.sum(tl.where(chosen, s, 0.0), axis=1), 1.0)
            wdot = tl.sum(g_s * s, axis=1) / ssel
            g_s = tl.where(chosen, (g_s - wdot[:, None]) / ssel[:, None], 0.0)
    g_q = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DAUX:
        c = tl.load(counts_ptr + cols, mask=cmask, other=0).to(tl.float32)
        a = tl.load(daux_ptr).to(tl.float32) * E * c / (T * K) / T
        g_q += a[None, :]
    if SIGMOID:
        if HAS_DAUX:
            g_s += (g_q - tl.sum(g_q * q, axis=1)[:, None]) / tl.sum(s, axis=1)[:, None]
        dl = g_s * s * (1.0 - s)
        g_p = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    else:
        dl = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        g_p = g_s + g_q
    dl += p * (g_p - tl.sum(g_p * p, axis=1)[:, None])
    if HAS_DZ:
        dl += (tl.load(dz_ptr).to(tl.float32) * 2.0 / T) * lse[:, None] * p
    ptrs = dl_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :]
    tl.store(ptrs, dl.to(dl_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


class MoERouting(NamedTuple):
    """What :func:`moe_router` returns (``T`` tokens, ``k`` experts each, ``E`` experts)."""

    indices: torch.Tensor   #: [T, k] int32 chosen experts, by decreasing score
    weights: torch.Tensor   #: [T, k] fp32 routing weights (differentiable)
    aux_loss: torch.Tensor  #: 0-d fp32 load-balancing loss E * sum_i f_i P_i (differentiable)
    z_loss: torch.Tensor    #: 0-d fp32 router z-loss mean(logsumexp(logits)^2) (differentiable)
    counts: torch.Tensor    #: [E] int32 assignments per expert
    max_load: torch.Tensor  #: 0-d fp32 max_i counts_i / (T k / E), 1.0 when balanced


def _block_t(T: int, block_e: int) -> int:
    """Tokens per program: a [BLOCK_T, BLOCK_E] fp32 tile of about 2048 elements per 4 warps on
    the GPU; under the interpreter all tokens in as few programs as possible."""
    if interpreting():
        return min(next_pow2(T), 256)
    return max(1, min(next_pow2(T), 2048 // block_e))


def check_router_args(logits, top_k, score):
    check_tensor("logits", logits, ndim=2)
    T, E = logits.shape
    if T == 0 or E == 0:
        raise ValueError(f"logits must have at least one token and one expert, got shape {tuple(logits.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")


def moe_router_fwd(logits: torch.Tensor, top_k: int, score: str = "softmax", normalize: bool = True):
    """Launch the router forward; returns (indices, weights, aux_loss, z_loss, counts, max_load)."""
    check_router_args(logits, top_k, score)
    l2 = rows_view(logits, logits.shape[-1])
    T, E = l2.shape
    dev = l2.device
    block_e = next_pow2(E)
    block_t = _block_t(T, block_e)
    G = triton.cdiv(T, block_t)
    indices = torch.empty((T, top_k), dtype=torch.int32, device=dev)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    pcount = torch.empty((G, E), dtype=torch.int32, device=dev)
    pprob = torch.empty((G, E), dtype=torch.float32, device=dev)
    pz = torch.empty((G,), dtype=torch.float32, device=dev)
    _moe_router_fwd_kernel[(G,)](
        l2, l2.stride(0), indices, weights, pcount, pprob, pz, T, E,
        K=top_k, K_PAD=next_pow2(top_k), SIGMOID=score == "sigmoid", NORMALIZE=bool(normalize),
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
    )
    counts = torch.empty((E,), dtype=torch.int32, device=dev)
    aux, z, max_load = (torch.empty((), dtype=torch.float32, device=dev) for _ in range(3))
    _moe_router_reduce_kernel[(1,)](
        pcount, pprob, pz, counts, aux, z, max_load, G, T, E,
        K=top_k, BLOCK_G=max(1, min(next_pow2(G), 4096 // block_e)), BLOCK_E=block_e, num_warps=4,
    )
    return indices, weights, aux, z, counts, max_load


def moe_router_bwd(logits, indices, counts, d_weights, d_aux, d_z, score: str = "softmax",
                   normalize: bool = True) -> torch.Tensor:
    """Gradient of the logits from those of the weights, aux_loss and z_loss (each may be None)."""
    l2 = rows_view(logits, logits.shape[-1])
    T, E = l2.shape
    top_k = indices.shape[1]
    block_e = next_pow2(E)
    block_t = _block_t(T, block_e)
    dl = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if d_weights is not None:
        d_weights = d_weights.contiguous()
    _moe_router_bwd_kernel[(triton.cdiv(T, block_t),)](
        l2, l2.stride(0), indices,
        d_weights if d_weights is not None else l2, counts,
        d_aux if d_aux is not None else l2, d_z if d_z is not None else l2,
        dl, T, E,
        K=top_k, SIGMOID=score == "sigmoid", NORMALIZE=bool(normalize),
        HAS_DW=d_weights is not None, HAS_DAUX=d_aux is not None, HAS_DZ=d_z is not None,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
    )
    return dl.view(logits.shape)


def _moe_router_setup(ctx, inputs, output):
    """``output`` in the op's order: ``(weights, aux, z, max_load, indices, counts)``."""
    logits, _, ctx.score, ctx.normalize = inputs
    _, _, _, max_load, indices, counts = output
    ctx.save_for_backward(logits, indices, counts)
    ctx.mark_non_differentiable(indices, counts, max_load)
    ctx.set_materialize_grads(False)


def _moe_router_backward(ctx, d_weights, d_aux, d_z, _d_max_load, _d_indices, _d_counts, *, bwd=moe_router_bwd):
    """``(dlogits, None, None, None)`` by ``bwd`` (the launcher eagerly, the backward op under
    torch.compile), the gradients in the op's output order; None when no float output got one."""
    if d_weights is None and d_aux is None and d_z is None:
        return None, None, None, None
    logits, indices, counts = ctx.saved_tensors
    return bwd(logits, indices, counts, d_weights, d_aux, d_z, ctx.score, ctx.normalize), None, None, None


class MoERouterFunction(torch.autograd.Function):
    """The launchers with :func:`_moe_router_setup` and :func:`_moe_router_backward`, the custom op's
    formula too; returns the outputs in the launcher's order (indices first)."""

    @staticmethod
    def forward(ctx, logits, top_k, score, normalize):
        indices, weights, aux, z, counts, max_load = moe_router_fwd(logits, top_k, score, normalize)
        _moe_router_setup(ctx, (logits, top_k, score, normalize), (weights, aux, z, max_load, indices, counts))
        return indices, weights, aux, z, counts, max_load

    @staticmethod
    def backward(ctx, d_indices, d_weights, d_aux, d_z, d_counts, d_max_load):
        return _moe_router_backward(ctx, d_weights, d_aux, d_z, d_max_load, d_indices, d_counts)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::moe_router_fwd", mutates_args=())
def moe_router_fwd_op(logits: Tensor, top_k: int, score: str,
                      normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(weights, aux_loss, z_loss, max_load, indices, counts)`` of :func:`kernels.moe_router.moe_router_fwd`:
    the float outputs first (opcheck's AOT check sums the outputs into the first one's dtype)."""
    indices, weights, aux, z, counts, max_load = moe_router_fwd(logits, top_k, score, normalize)
    return weights, aux, z, max_load, indices, counts


@fake(moe_router_fwd_op)
def _(logits, top_k, score, normalize):
    check_router_args(logits, top_k, score)
    T, E = logits.shape
    i32, f32 = dict(dtype=torch.int32), dict(dtype=torch.float32)
    return (logits.new_empty((T, top_k), **f32), logits.new_empty((), **f32), logits.new_empty((), **f32),
            logits.new_empty((), **f32), logits.new_empty((T, top_k), **i32), logits.new_empty(E, **i32))


@define("tritonllm::moe_router_bwd", mutates_args=())
def moe_router_bwd_op(logits: Tensor, indices: Tensor, counts: Tensor, d_weights: Optional[Tensor],
                      d_aux: Optional[Tensor], d_z: Optional[Tensor], score: str, normalize: bool) -> Tensor:
    """The logits' gradient of :func:`kernels.moe_router.moe_router_bwd` (each given gradient may be None)."""
    return moe_router_bwd(logits, indices, counts, d_weights, d_aux, d_z, score, normalize)


@fake(moe_router_bwd_op)
def _(logits, indices, counts, d_weights, d_aux, d_z, score, normalize):
    return logits.new_empty(logits.shape)


register_formula(moe_router_fwd_op, _moe_router_setup, _moe_router_backward, bwd=moe_router_bwd_op)


@compiled("moe_router")
def _compiled_moe_router(logits: Tensor, top_k: int, score: str = "softmax", normalize: bool = True) -> MoERouting:
    weights, aux, z, max_load, indices, counts = moe_router_fwd_op(logits, top_k, score, normalize)
    return MoERouting(indices, weights, aux, z, counts, max_load)


@compilable
def moe_router(logits: torch.Tensor, top_k: int, score: str = "softmax", normalize: bool = True) -> MoERouting:
    """Choose ``top_k`` experts per token and compute the router losses.

    Args:
        logits: ``[T, E]`` router logits (fp32, fp16 or bf16), e.g. ``linear(x, router_weight)``.
        top_k: experts per token, ``1 <= top_k <= E``.
        score: ``"softmax"`` (Switch, Mixtral, OLMoE) or ``"sigmoid"`` (DeepSeek-V3) expert scores.
        normalize: rescale the k chosen scores to sum to 1.

    Returns:
        :class:`MoERouting` ``(indices [T, k] int32, weights [T, k] fp32, aux_loss, z_loss,
        counts [E] int32, max_load)``; ``weights``, ``aux_loss`` and ``z_loss`` are
        differentiable with respect to ``logits``. See the module docstring for the math.
    """
    return MoERouting(*MoERouterFunction.apply(logits, top_k, score, normalize))
