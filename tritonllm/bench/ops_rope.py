"""Benchmarks of ``rope`` (q and k rotated together) and ``embedding`` against torch eager,
torch.compile and, for RoPE, Liger-Kernel.

Ours is called the way the training path calls it: rope rotates q and k in one call as the packed
q|k slice of a qkv projection, embedding skips the host-side id range check (``validate=False``).

Sizes: rope "default" = q and k [16, 1024, 12, 64] (B, T, H, D, void125m), "large" = q
[4, 8192, 32, 128] and k [4, 8192, 8, 128] (GQA 32:8); embedding "default" = 16384 ids into
32000 x 768, "large" = 32768 ids into 131072 x 4096. All memory-bound: rope reads q, k and the fp32
cos/sin tables once and writes the rotated q, k (the backward likewise with dq, dk); the embedding
forward reads the ids and the gathered rows and writes the output, its backward reads dy and writes
the whole dense dW.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.bench import reference_ops as ref
from tritonllm.bench.harness import Case, compiled, liger_available, with_host
from tritonllm.kernels import embedding, rope, rope_cos_sin

OPS = ["rope", "embedding"]

#: rope: (B, T, Hq, Hkv, D); embedding: (tokens, vocab, hidden)
SHAPES = {
    "default": {"rope": (16, 1024, 12, 12, 64), "embedding": (16384, 32000, 768)},
    "large": {"rope": (4, 8192, 32, 8, 128), "embedding": (32768, 131072, 4096)},
}
#: small problems at which the host time of one call is measured (size "default")
HOST_SHAPES = {"rope": (1, 16, 12, 12, 64), "embedding": (8, 32000, 768)}


def _rope_qk_torch(q, k, cos, sin, cos_full, sin_full):
    """Half-split RoPE of q and k in their dtype, the tables cast to it as PyTorch models do."""
    return ref.rope(q, cos, sin), ref.rope(k, cos, sin)


def _packed_qk(inputs):
    """Ours' inputs: q and k copied into a packed [B, T, Hq + 2 Hkv, D] qkv buffer (the model's
    projection layout: heads [0, Hq) are q, [Hq, Hq + Hkv) k, the rest v) and the q|k slice of it
    as a strided leaf, so the timed backward is rope's own (in the model the slice's gradient
    lands in the qkv gradient through autograd, not timed here)."""
    q, k, cos, sin = inputs[:4]
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device=q.device, dtype=q.dtype)
    qkv[:, :, :hq] = q.detach()
    qkv[:, :, hq:hq + hkv] = k.detach()
    return qkv[:, :, :hq + hkv].detach().requires_grad_(), cos, sin


def _rope_qk_ours(qk, cos, sin):
    return rope(qk, cos, sin)


def _rope_qk_liger(q, k, cos, sin, cos_full, sin_full):
    from liger_kernel.ops.rope import LigerRopeFunction

    # Liger takes q, k as [B, H, T, D] views of [B, T, H, D] storage and cos/sin as [1, T, D] (the
    # half table repeated, built untimed in make_inputs). The transposes here are free views:
    # Liger transposes back to the physical [B, T, H, D] layout, and returning [B, T, H, D] views
    # keeps dy in that layout too, so nothing is copied and no transpose is timed. Liger rotates
    # q, k in place in the forward and dq, dk (the harness's reused dy) in the backward: values
    # change between repetitions, magnitudes and timings do not.
    q_out, k_out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos_full, sin_full)[:2]
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _rope_case(b: int, t: int, hq: int, hkv: int, d: int, *, dtype: torch.dtype) -> Case:
    def make_inputs():
        q = torch.randn(b, t, hq, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, t, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
        cos, sin = rope_cos_sin(t, d, device="cuda")
        return q, k, cos, sin, torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]

    baselines = {"torch": _rope_qk_torch, "torch.compile": compiled(_rope_qk_torch)}
    if liger_available():
        baselines["liger"] = _rope_qk_liger
    es = torch.finfo(dtype).bits // 8
    per_pass = 2 * b * t * (hq + hkv) * d * es + 2 * t * (d // 2) * 4  # read q, k, cos, sin; write q', k'
    # ours rotates the packed q|k view [B, T, Hq + Hkv, D] of a qkv tensor in one call (_packed_qk);
    # the baselines get their natural inputs, separate contiguous q and k
    return Case("rope", f"B{b} Hq{hq}/Hkv{hkv} T{t} D{d}", dtype, make_inputs, ours=_rope_qk_ours,
                baselines=baselines, bytes={"fwd": per_pass, "bwd": per_pass, "fwd+bwd": 2 * per_pass},
                ours_inputs=_packed_qk, reference=ref.rope)


def _embedding_torch(ids, weight):
    return F.embedding(ids, weight)


def _embedding_ours(ids, weight):
    # validate=False as on the training path (the data pipeline range-checks token ids when it loads
    # a corpus): no host-side min/max and device sync; F.embedding checks the ids on the device
    return embedding(ids, weight, validate=False)


def _embedding_case(n: int, v: int, d: int, *, dtype: torch.dtype) -> Case:
    def make_inputs():
        ids = torch.randint(0, v, (n,), device="cuda")
        weight = torch.randn(v, d, device="cuda", dtype=dtype, requires_grad=True)
        return ids, weight

    es = torch.finfo(dtype).bits // 8
    fwd = n * 8 + 2 * n * d * es  # read ids (int64) and the gathered rows; write out
    bwd = n * d * es + v * d * es  # read dy; write the dense dW
    # shape: tokens x hidden x vocab
    return Case("embedding", f"{n}x{d}x{v}", dtype, make_inputs, ours=_embedding_ours,
                baselines={"torch": _embedding_torch, "torch.compile": compiled(_embedding_torch)},
                bytes={"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}, reference=ref.embedding)


def cases(size: str, dtype: torch.dtype):
    rope_case = _rope_case(*SHAPES[size]["rope"], dtype=dtype)
    emb = _embedding_case(*SHAPES[size]["embedding"], dtype=dtype)
    if size == "default":
        with_host(rope_case, _rope_case(*HOST_SHAPES["rope"], dtype=dtype), "torch")
        with_host(emb, _embedding_case(*HOST_SHAPES["embedding"], dtype=dtype), "torch")
    yield rope_case
    yield emb
