"""Fused flash attention: causal (bottom-right), native GQA/MQA, sliding window, KV-cache decode.

Shapes: ``q`` is ``[B, T, Hq, D]``, ``k`` and ``v`` are ``[B, S, Hkv, D]`` with ``Hq % Hkv == 0``;
query head ``h`` reads key/value head ``h // (Hq / Hkv)``. Inputs may be strided views (e.g. slices
of a packed qkv projection); only the last dimension must be contiguous. Nothing is transposed.

Forward, per batch, query head h, query row i, with ``s = softmax_scale`` (default ``D**-0.5``)::

    visible(i, j) = j < S
                    and (not causal or j <= i + S - T)            # bottom-right aligned causal mask
                    and (window is None or j > i + S - T - window)  # the last `window` keys at most
    x_ij   = s * q_i . k_j                     for visible pairs, -inf otherwise
    lse_i  = log sum_j exp(x_ij)               (fp32 [B, Hq, T], -inf for a row that sees no key)
    o_i    = sum_j exp(x_ij - lse_i) v_j       (0 for a row that sees no key)

computed FlashAttention-2 style: one program per (query block, batch x query head) streams the
key/value tiles with an online softmax in base 2 (scores scaled by ``s * log2(e)`` inside the
exponent's FMA, ``exp2(x * s log2(e) - m)``, so the resident q tile stays an unscaled
shared-memory operand of the tensor-core product), fp32 accumulators. Key tiles wholly
outside a query block's causal/window range are skipped (the loop bounds are computed per query
block), tiles wholly inside are processed without masks: either in three loops (masked head,
mask-free middle, masked tail) or in one loop whose edge tiles take a masking branch (``one_loop``).
On sm90+ GPUs (and under the interpreter) 16-bit inputs with 16-byte aligned strides stream their
tiles through tensor descriptors (TMA, setting ``tma``); other inputs through masked pointer loads.
On Hopper, at the head dims of ``sm90_fwd`` (64 and 128 by default), the forward runs
FlashAttention-3's warp-specialized schedule instead, written in Gluon (``forward_sm90``: a producer
warp loading k and v tiles, two consumer warpgroups taking turns at the tensor cores, each overlapping
its softmax with its own products; persistent, one program an SM over a host-balanced list of query
tiles); ``sm90_bwd`` names, per kernel of the deterministic
backward, the head dims that run its Gluon version (``backward_sm90``): by default both kernels at
D128, faster there as measured; D64 stays portable. These switches (``tma``, ``one_loop``, the program
order ``group_waves``, ``sm90_fwd``, ``sm90_bwd``, ``sm90_fused``) are :class:`settings.AttentionSettings`,
changed through :func:`configure_attention`; the tile configs and thresholds are in ``tuning``.
Decode (``T <= 16``, or too few query blocks to fill the GPU) uses a split-KV (flash-decoding)
kernel instead: programs over (KV split, block of the group's query rows, batch x KV head) put
all ``Hq / Hkv`` query heads of a KV head in the M dimension of the tile, so each K/V tile is read
once per group, and write partial ``(o, lse)`` that a combine kernel merges.

Backward, with ``P_ij = exp(x_ij - lse_i)`` recomputed from the saved lse and ``dO`` the
output gradient::

    delta_i = sum_d dO_id O_id                                   (preprocess kernel)
    dV_j    = sum_{h in group(j), i} P_ij dO_i
    dS_ij   = P_ij (dO_i . v_j - delta_i)
    dK_j    = s * sum_{h in group(j), i} dS_ij q_i
    dQ_i    = s * sum_j dS_ij k_j

The backward has two variants. The default, ``deterministic=True``, is reproducible and, measured
on an H100 with Triton 3.6, the faster: the dK/dV kernel gives each program one key block of one KV
head; it loops over every query head of the group and the query blocks that see the key block,
accumulating dK and dV in registers; the dQ kernel gives each program one query block and loops over
key blocks. Seven tile products per (query, key) tile pair, no atomics. ``deterministic=False``
runs the fused kernel of FlashAttention-2: the same dK/dV kernel also adds its share of dQ (``dS k``,
without the scale) into an fp32 ``[B, Hq, T, D]`` buffer with atomic adds, and a finalize kernel
scales it into dQ: five products, but the order in which the atomics land varies, so dQ may differ
between runs in its last bits, and Triton's element-wise fp32 atomics cost more than the two
products they save (a TMA reduce-add, tried, cost more still). The preprocess
kernel computes delta and the base-2 lse (and zeroes the fused variant's dQ accumulator). All recompute
``P = exp2(s log2(e) q.k - lse log2(e))`` with one FMA per score and leave the resident tile
unscaled: pre-scaling it, as the forward does with q,
turns it from a shared-memory operand of the tensor-core product into a register one (+32
registers per thread at D128, enough to spill in dK/dV). With ``T == S`` the gradients are written
as head slices of one ``[B, T, Hq + 2 Hkv, D]`` buffer, the layout of a packed qkv projection's
gradient. Reference: Dao,
"FlashAttention-2" (2023); Triton's fused-attention tutorial.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..checks import check_tensor, needs_grad
from ..custom_op import compilable, compiled, define, eager, fake, formula_function, register_formula
from ..rope import rope, rope_fwd, rope_grad
from ..split_heads import split_heads
from .backward import flash_attention_bwd, flash_attention_bwd_packed
from .forward import flash_attention_decode, flash_attention_fwd
from .settings import AttentionSettings, attention_settings, configure_attention
from .tuning import DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS, HEAD_DIMS

__all__ = ["flash_attention", "rope_flash_attention", "rope_qkv", "flash_attention_fwd", "flash_attention_bwd",
           "flash_attention_bwd_packed", "flash_attention_decode",
           "FlashAttentionFunction", "AttentionSettings", "attention_settings", "configure_attention", "HEAD_DIMS",
           "FWD_CONFIGS", "DKDV_CONFIGS", "DQ_CONFIGS"]


# ----------------------------------------------------------------------------- autograd + functional

def _flash_attention_setup(ctx, inputs, output):
    """Of the forward's inputs ``(q, k, v, causal, window, softmax_scale, deterministic, documents)`` and
    ``(o, lse)``: saves q, k, v, the output, the fp32 log-sum-exp and the documents, keeps the options."""
    q, k, v, *ctx.options, documents = inputs
    ctx.save_for_backward(q, k, v, *output, documents)


def _flash_attention_backward(ctx, do, _dlse=None, *, bwd=flash_attention_bwd):
    """``(dq, dk, dv, None x 5)`` by ``bwd``: :func:`flash_attention_bwd` eagerly (the Function binds its
    ``packed``), the backward op under torch.compile."""
    *saved, documents = ctx.saved_tensors
    dq, dk, dv = bwd(do, *saved, *ctx.options, documents)
    return dq, dk, dv, None, None, None, None, None


class FlashAttentionFunction(torch.autograd.Function):
    """:func:`flash_attention_fwd` with :func:`_flash_attention_setup` and :func:`_flash_attention_backward`,
    the custom op's formula too; returns ``o``. Where q, k, v share the ``(B, T)`` of a packed projection,
    the backward writes the three gradients as slices of one buffer (``packed``, which an op's outputs may
    not be: they may not alias one another)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, softmax_scale, deterministic, documents):
        o, lse = flash_attention_fwd(q, k, v, causal, window, softmax_scale, documents=documents)
        _flash_attention_setup(ctx, (q, k, v, causal, window, softmax_scale, deterministic, documents), (o, lse))
        ctx.packed = q.shape[:2] == k.shape[:2]
        return o

    @staticmethod
    def backward(ctx, do):
        return _flash_attention_backward(ctx, do, bwd=functools.partial(flash_attention_bwd, packed=ctx.packed))


def rope_flash_attention_fwd(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int, causal: bool = True,
                             window: Optional[int] = None, softmax_scale: Optional[float] = None,
                             deterministic: bool = True,
                             documents: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(o, lse, qk)`` of :func:`rope_flash_attention`: RoPE on the query and key heads of ``qkv``
    (:func:`kernels.rope.rope_fwd` into ``qk [B, T, n_heads + n_kv_heads, D]``, kept for the backward), then
    :func:`flash_attention_fwd` on its head slices and ``qkv``'s value heads. ``deterministic`` is the
    backward's switch, carried here for the pair."""
    qk = rope_fwd(qkv[:, :, :n_heads + n_kv_heads], cos, sin)
    q, k = qk.split((n_heads, n_kv_heads), dim=2)
    o, lse = flash_attention_fwd(q, k, qkv[:, :, n_heads + n_kv_heads:], causal, window, softmax_scale,
                                 documents=documents)
    return o, lse, qk


def rope_flash_attention_bwd(do: Tensor, qk: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, cos: Tensor, sin: Tensor,
                             n_heads: int, n_kv_heads: int, causal: bool, window: Optional[int],
                             softmax_scale: Optional[float], deterministic: bool, documents: Optional[Tensor]) -> Tensor:
    """The gradient of ``qkv`` ``[B, T, n_heads + 2 n_kv_heads, D]``: the attention backward into one packed
    buffer (:func:`flash_attention_bwd_packed`), its query and key heads then rotated back where they lie
    (:func:`kernels.rope.rope_grad` in place: a head slice of a fresh buffer owns its elements), so nothing
    is copied."""
    q, k = qk.split((n_heads, n_kv_heads), dim=2)
    dqkv = flash_attention_bwd_packed(do, q, k, qkv[:, :, n_heads + n_kv_heads:], o, lse, causal, window,
                                      softmax_scale, deterministic, documents)
    rope_grad(dqkv[:, :, :n_heads + n_kv_heads], cos, sin, 0, None, in_place=True)
    return dqkv


def _rope_flash_attention_setup(ctx, inputs, output):
    """Of the forward's inputs and ``(o, lse, qk)``: saves the rotated ``qk``, ``qkv`` (its value heads), the
    output, the log-sum-exp, the tables and the documents; keeps the options."""
    qkv, cos, sin, *ctx.options, documents = inputs
    o, lse, qk = output
    ctx.save_for_backward(qk, qkv, o, lse, cos, sin, documents)


def _rope_flash_attention_backward(ctx, do, _dlse=None, _dqk=None, *, bwd=rope_flash_attention_bwd):
    """``(dqkv, None x 9)`` by ``bwd``: :func:`rope_flash_attention_bwd` eagerly, the backward op under
    torch.compile."""
    *saved, documents = ctx.saved_tensors
    return (bwd(do, *saved, *ctx.options, documents),) + (None,) * 9


#: :func:`rope_flash_attention_fwd` with :func:`_rope_flash_attention_setup` and
#: :func:`_rope_flash_attention_backward`, the custom op's formula too; returns ``o``
RopeFlashAttentionFunction = formula_function("RopeFlashAttentionFunction", rope_flash_attention_fwd,
                                              _rope_flash_attention_setup, _rope_flash_attention_backward, first=True)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::flash_attention_fwd", mutates_args=())
def flash_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: Optional[int],
                           softmax_scale: Optional[float], deterministic: bool,
                           documents: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(o, lse)`` of :func:`kernels.flash_attention.flash_attention_fwd`; ``deterministic`` is the
    backward's switch, carried here for the autograd formula."""
    return flash_attention_fwd(q, k, v, causal, window, softmax_scale, documents=documents)


@fake(flash_attention_fwd_op)
def _(q, k, v, causal, window, softmax_scale, deterministic, documents):
    B, T, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, T), dtype=torch.float32)


@define("tritonllm::flash_attention_bwd", mutates_args=())
def flash_attention_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                           window: Optional[int], softmax_scale: Optional[float],
                           deterministic: bool, documents: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`kernels.flash_attention.flash_attention_bwd`, each in a tensor of its
    own (not its ``packed`` form: an op's outputs may not alias one another)."""
    return flash_attention_bwd(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents)


@fake(flash_attention_bwd_op)
def _(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


register_formula(flash_attention_fwd_op, _flash_attention_setup, _flash_attention_backward, bwd=flash_attention_bwd_op)


@compiled("flash_attention")
def _compiled_flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, window: int | None = None,
                              softmax_scale: float | None = None, deterministic: bool = True,
                              documents: Tensor | None = None) -> Tensor:
    return flash_attention_fwd_op(q, k, v, causal, window, softmax_scale, deterministic, documents)[0]


@define("tritonllm::rope_flash_attention_fwd", mutates_args=())
def rope_flash_attention_fwd_op(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int, causal: bool,
                                window: Optional[int], softmax_scale: Optional[float], deterministic: bool,
                                documents: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(o, lse, qk)`` of :func:`kernels.flash_attention.rope_flash_attention_fwd`."""
    return rope_flash_attention_fwd(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic,
                                    documents)


@fake(rope_flash_attention_fwd_op)
def _(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic, documents):
    B, T, _, D = qkv.shape
    return (qkv.new_empty((B, T, n_heads, D)), qkv.new_empty((B, n_heads, T), dtype=torch.float32),
            qkv.new_empty((B, T, n_heads + n_kv_heads, D)))


@define("tritonllm::rope_flash_attention_bwd", mutates_args=())
def rope_flash_attention_bwd_op(do: Tensor, qk: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, cos: Tensor, sin: Tensor,
                                n_heads: int, n_kv_heads: int, causal: bool, window: Optional[int],
                                softmax_scale: Optional[float], deterministic: bool,
                                documents: Optional[Tensor]) -> Tensor:
    """The gradient of ``qkv``: :func:`kernels.flash_attention.rope_flash_attention_bwd` (its buffer is the
    op's own output, rotated in place inside the op)."""
    return rope_flash_attention_bwd(do, qk, qkv, o, lse, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale,
                                    deterministic, documents)


@fake(rope_flash_attention_bwd_op)
def _(do, qk, qkv, o, lse, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic, documents):
    return qkv.new_empty(qkv.shape)


register_formula(rope_flash_attention_fwd_op, _rope_flash_attention_setup, _rope_flash_attention_backward,
                 bwd=rope_flash_attention_bwd_op)


@compiled("rope_flash_attention")
def _compiled_rope_flash_attention(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int, causal: bool = True,
                                   window: int | None = None, softmax_scale: float | None = None, deterministic: bool = True,
                                   documents: Tensor | None = None) -> Tensor:
    check_packed_heads(qkv, n_heads, n_kv_heads)
    return rope_flash_attention_fwd_op(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic,
                                       documents)[0]


@define("tritonllm::flash_attention_decode", mutates_args=())
def flash_attention_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: Tensor, causal: bool,
                              window: Optional[int], softmax_scale: Optional[float], split_kv: Optional[int]) -> Tensor:
    """:func:`kernels.flash_attention.flash_attention_decode` (forward only)."""
    return eager(flash_attention_decode)(q, k_cache, v_cache, kv_len, causal, window, softmax_scale, split_kv)


@fake(flash_attention_decode_op)
def _(q, k_cache, v_cache, kv_len, causal, window, softmax_scale, split_kv):
    return q.new_empty(q.shape)


@compiled("flash_attention_decode")
def _compiled_flash_attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: Tensor, causal: bool = True,
                                     window: int | None = None, softmax_scale: float | None = None,
                                     split_kv: int | None = None) -> Tensor:
    return flash_attention_decode_op(q, k_cache, v_cache, kv_len, causal, window, softmax_scale, split_kv)


@compilable
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    window: int | None = None, softmax_scale: float | None = None,
                    deterministic: bool = True, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``softmax(s * q k^T + mask) v`` with GQA/MQA, computed without the T x S matrix.

    Args:
        q: ``[B, T, Hq, D]`` queries; k, v: ``[B, S, Hkv, D]`` keys and values, ``Hq % Hkv == 0``
            (query head h uses KV head ``h // (Hq // Hkv)``). Any strides with a contiguous last
            dimension (e.g. slices of a packed ``[B, T, Hq + 2 Hkv, D]`` projection).
            D in (32, 64, 96, 128, 256); fp16/bf16 (fp32 accepted, computed exactly, slower).
        causal: query i sees keys ``j <= i + S - T`` (bottom-right aligned, so T = 1 against a KV
            cache of S keys sees them all). Query rows that see no key (T > S) output 0.
        window: sliding window (needs ``causal=True``): query i sees only keys
            ``i + S - T - window < j <= i + S - T``, the last ``window`` keys, itself included.
            Work grows with T * window, not T * S.
        softmax_scale: ``s``, default ``1 / sqrt(D)``.
        deterministic: True (default): the backward without atomics, bitwise reproducible (a dK/dV
            and a dQ kernel, seven tile products per tile pair). False: one fused kernel with five
            products that adds dQ with fp32 atomics, whose order varies between runs. On an H100 with
            Triton 3.6 the atomics cost more than the two products they save (B8 Hq32/Hkv8 T4096 D128
            backward 8.9 ms fused against 7.2 ms; ``docs/perf/history.md``), so the reproducible one is
            also the faster default.
        documents: packed sequences (varlen attention in a ``[B, T]`` batch): int32 ``[B, T, 2]``
            holding, for each position, the first position of its document and one past its last
            (``tritonllm.data.sft.document_bounds`` builds it). A query then sees only keys of its own
            document (with ``causal``, those at or before it), so packed examples never attend to each
            other; tiles wholly outside a query block's documents are skipped. Needs ``T == S``.

    Returns:
        ``[B, T, Hq, D]`` contiguous, in the dtype of q. Differentiable in q, k, v; with ``T == S``
        the three gradients are slices of one ``[B, T, Hq + 2 Hkv, D]`` buffer (a packed qkv
        projection's gradient layout).
    """
    if needs_grad(q, k, v):
        return FlashAttentionFunction.apply(q, k, v, causal, window, softmax_scale, deterministic, documents)
    return flash_attention_fwd(q, k, v, causal, window, softmax_scale, documents=documents)[0]  # nothing to differentiate


def check_packed_heads(qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> None:
    """``qkv`` is ``[B, T, n_heads + 2 n_kv_heads, D]`` with ``n_heads`` a multiple of ``n_kv_heads``."""
    check_tensor("qkv", qkv, ndim=4)
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads: {n_heads} must be a positive multiple of n_kv_heads ({n_kv_heads})")
    if qkv.shape[2] != n_heads + 2 * n_kv_heads:
        raise ValueError(f"qkv: {qkv.shape[2]} heads, expected n_heads + 2 n_kv_heads = {n_heads + 2 * n_kv_heads}")


@compilable
def rope_flash_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                         causal: bool = True, window: int | None = None, softmax_scale: float | None = None,
                         deterministic: bool = True, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Self-attention over a packed projection: RoPE on its query and key heads, then :func:`flash_attention`.

    Args:
        qkv: ``[B, T, n_heads + 2 n_kv_heads, D]``, the query, key and value heads in that order (a
            packed qkv projection viewed by heads); unit last stride.
        cos, sin: RoPE tables as for :func:`~tritonllm.kernels.rope`, position 0 at row 0.
        causal, window, softmax_scale, deterministic, documents: as for :func:`flash_attention`.

    Returns:
        ``[B, T, n_heads, D]``, the same as ``flash_attention(rope(q), rope(k), v, ...)``. The gradient
        of ``qkv`` is one buffer: the attention backward writes dq, dk and dv into its head slices and
        the RoPE backward rotates dq and dk there in place, so nothing is copied, eagerly (one autograd
        Function) and under ``torch.compile`` (one op each way, with the Function's setup/backward pair,
        where the separate ops would return three gradients to be packed by a copy).
    """
    check_packed_heads(qkv, n_heads, n_kv_heads)
    if needs_grad(qkv):
        return RopeFlashAttentionFunction.apply(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale,
                                                deterministic, documents)
    return rope_flash_attention_fwd(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic,
                                    documents)[0]  # nothing to differentiate: no autograd node


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
             position_offset: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rope(q), rope(k), v)`` of a packed ``qkv [B, T, n_heads + 2 n_kv_heads, D]`` for attention: the
    query and key heads rotated in one launch, v a view. RoPE's backward rotates in place, so it is only
    for outputs that feed attention alone; :func:`flash_attention`'s backward then writes dq, dk, dv as
    slices of one buffer that reaches ``qkv`` as its gradient without a copy."""
    qk, v = split_heads(qkv, (n_heads + n_kv_heads, n_kv_heads))
    q, k = split_heads(rope(qk, cos, sin, position_offset=position_offset, in_place_backward=True),
                       (n_heads, n_kv_heads))
    return q, k, v
