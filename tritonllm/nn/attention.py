"""Causal self-attention over ``tritonllm.kernels.flash_attention``, and its static KV cache.

One packed QKV GEMM, viewed as ``[B, T, Hq + 2 Hkv, D]`` and split into strided q, k, v views (no
copies); optional QK-norm (RMSNorm over D); RoPE on q and k; flash attention (GQA/MQA, causal,
optional sliding window); output GEMM. With a :class:`KVCache` the keys and values are written into
the cache and attention runs over every cached position (prefill), or, in :meth:`Attention.decode`,
over the first ``kv_len`` rows of the cache at fixed shapes (one token per step, CUDA-graph safe).
"""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.flash_attention import flash_attention, flash_attention_decode, rope_flash_attention, rope_qkv
from tritonllm.kernels.kv_cache import kv_cache_write_
from tritonllm.kernels.residual_mix import weighted_add
from tritonllm.kernels.rope import rope
from tritonllm.kernels.split_heads import split_heads
from tritonllm.nn.linear import Linear
from tritonllm.nn.norm import RMSNorm

QK_NORM_SPANS = ("head", "all")


class KVCache:
    """Static keys and values, ``[B, max_len, n_kv_heads, head_dim]`` per layer, and how many positions
    are filled.

    ``pos`` is the fill position as a 0-d int32 tensor on the cache's device. The kernels read it
    from device memory (the RoPE offset, the row :func:`kv_cache_write_` writes, the number of keys
    :func:`flash_attention_decode` attends to), so one decode step has fixed shapes and can be
    captured in a CUDA graph and replayed while ``pos`` advances. ``length`` is the same count as the
    host knows it: a forward with a cache (the prompt's prefill, whose key views need host shapes)
    attends to the cached positions plus its own and advances both (:meth:`advance`); a decode step
    advances ``pos`` alone, on the device.
    """

    def __init__(self, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
                 device=None, dtype=None):
        shape = (batch_size, max_len, n_kv_heads, head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_len = max_len
        self.pos = torch.zeros((), dtype=torch.int32, device=device)
        self.length = 0

    def reset(self) -> None:
        """Empty the cache (``pos`` and ``length`` 0; the buffers keep their addresses)."""
        self.pos.zero_()
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v [B, T, Hkv, D]`` at positions ``pos .. pos+T-1`` (read on the device); return
        views of the ``length + T`` filled positions."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache of max_len {self.max_len} cannot hold {end} positions")
        kv_cache_write_(k, v, self.k[layer], self.v[layer], self.pos)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, n: int) -> None:
        """Count ``n`` more filled positions, on the device and on the host."""
        self.pos += n
        self.length += n


class Attention(nn.Module):
    """Self-attention ``[B, T, d_model] -> [B, T, d_model]`` with GQA/MQA, RoPE, optional QK-norm and
    optional sliding window.

    Args:
        d_model: input and output width.
        n_heads: query heads; ``n_kv_heads`` key/value heads (None: ``n_heads``; 1: MQA), dividing it.
        head_dim: width of a head (None: ``d_model // n_heads``); even (RoPE rotates pairs).
        qkv_bias: biases on the packed QKV projection (Qwen2).
        qk_norm: RMSNorm (weights ``q_norm``, ``k_norm``, epsilon ``eps``) on queries and keys before
            RoPE, over ``qk_norm_span``: ``"head"``, each head's ``D`` values (Qwen3), or ``"all"``,
            each token's ``Hq D`` query and ``Hkv D`` key values (OLMoE), for a query row ``q``
            ``q <- q / sqrt(mean(q^2) + eps) * q_norm`` with the mean over that span.
        window: sliding-window span in tokens (query t sees keys ``t - window < s <= t``); None: full.
        causal: causal mask (bottom-right aligned with a cache).
        value_mix: learn ``value_mix = [a, b]`` (init 0.5, 0.5) mixing a value embedding ``ve`` into
            the values, ``v = a v + b ve`` (modded-nanogpt's value embeddings).
        layer_idx: this layer's index in a :class:`KVCache`.
        init_std: std of the normal init of ``qkv``; ``out_std`` of ``proj`` (None: ``init_std``).

    Parameters: ``qkv`` (:class:`Linear` ``[(Hq + 2 Hkv) D, d_model]``, rows q then k then v),
    ``proj`` (:class:`Linear` ``[d_model, Hq D]``), and as configured ``q_norm``, ``k_norm``,
    ``value_mix``. ``forward(x, cos, sin, cache=None, ve=None, documents=None)``: ``cos, sin [max_len, D / 2]``
    RoPE tables (``tritonllm.kernels.rope_cos_sin``), rows from the cache's fill position on;
    ``documents`` the int32 ``[B, T, 2]`` bounds of packed sequences (:func:`flash_attention`).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None, *,
                 qkv_bias: bool = False, qk_norm: bool = False, qk_norm_span: str = "head", eps: float = 1e-6,
                 window: int | None = None, causal: bool = True, value_mix: bool = False, layer_idx: int = 0,
                 init_std: float = 0.02, out_std: float | None = None, device=None, dtype=None):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) is not divisible by n_heads ({n_heads}); give head_dim")
            head_dim = d_model // n_heads
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window, self.causal, self.layer_idx = window, causal, layer_idx
        kw = dict(device=device, dtype=dtype)
        self.qkv = Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias, init_std=init_std, **kw)
        if qk_norm_span not in QK_NORM_SPANS:
            raise ValueError(f"qk_norm_span must be one of {QK_NORM_SPANS}, got {qk_norm_span!r}")
        self.qk_norm_span = qk_norm_span
        q_width, k_width = (n_heads * head_dim, n_kv_heads * head_dim) if qk_norm_span == "all" else (head_dim,) * 2
        self.q_norm = RMSNorm(q_width, eps, **kw) if qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, **kw) if qk_norm else None
        self.proj = Linear(n_heads * head_dim, d_model, init_std=init_std if out_std is None else out_std, **kw)
        self.value_mix = nn.Parameter(torch.full((2,), 0.5, **kw)) if value_mix else None  # [a, b]: v = a v + b ve

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        """The qkv projection of ``x [B, T, d_model]`` viewed by heads: ``[B, T, Hq + 2 Hkv, D]``."""
        B, T, _ = x.shape
        return self.qkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)

    def _qkv(self, x: torch.Tensor, cos, sin, pos, ve: torch.Tensor | None):
        """q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` of ``x [B, T, d_model]`` at RoPE offset ``pos``."""
        Hq, Hkv = self.n_heads, self.n_kv_heads
        qkv = self._packed(x)
        if self.q_norm is None or self.k_norm is None:
            q, k, v = rope_qkv(qkv, cos, sin, Hq, Hkv, pos)
        else:  # RoPE's outputs feed only the attention: its backward rotates the attention's gradient in place
            q, k, v = split_heads(qkv, (Hq, Hkv, Hkv))
            q = rope(self._norm(self.q_norm, q), cos, sin, position_offset=pos, in_place_backward=True)
            k = rope(self._norm(self.k_norm, k), cos, sin, position_offset=pos, in_place_backward=True)
        if ve is not None:  # the layer's value embedding [B, T, Hkv * D]
            v = weighted_add(v, ve.view(v.shape), self.value_mix)
        return q, k, v

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm`` of the heads ``x [B, T, H, D]`` over each head, or over each token's ``H D`` values
        (span ``"all"``: ``x`` viewed ``[B, T, H D]``, the heads of one token being adjacent)."""
        if self.qk_norm_span == "head":
            return norm(x)
        return norm(x.flatten(2)).view(x.shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                ve: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, d_model]``; with ``cache``, keys and values are appended to it and the queries
        attend to every filled position (the caller advances the cache after the last layer); with
        ``documents``, a query attends only to its own packed document."""
        B, T, _ = x.shape
        if cache is None and ve is None and (self.q_norm is None or self.k_norm is None):  # training: one call
            y = rope_flash_attention(self._packed(x), cos, sin, self.n_heads, self.n_kv_heads, causal=self.causal,
                                     window=self.window, documents=documents)
        else:
            q, k, v = self._qkv(x, cos, sin, 0 if cache is None else cache.pos, ve)
            if cache is not None:
                k, v = cache.append(self.layer_idx, k, v)
            y = flash_attention(q, k, v, causal=self.causal, window=self.window, documents=documents)
        return self.proj(y.reshape(B, T, self.n_heads * self.head_dim))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, kv_len: torch.Tensor,
               ve: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, 1, d_model]`` at the cache's device position: RoPE at ``cache.pos``, key and value
        written at that row (:func:`kv_cache_write_`), split-KV attention over the cache's first
        ``kv_len`` rows (:func:`flash_attention_decode`); fixed shapes, no host read of ``pos``."""
        B = x.shape[0]
        q, k, v = self._qkv(x, cos, sin, cache.pos, ve)
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        kv_cache_write_(k, v, k_cache, v_cache, cache.pos)
        y = flash_attention_decode(q, k_cache, v_cache, kv_len, causal=self.causal, window=self.window)
        return self.proj(y.reshape(B, 1, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        s = (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
             f"head_dim={self.head_dim}, causal={self.causal}, window={self.window}, qk_norm={self.q_norm is not None}, "
             f"qk_norm_span={self.qk_norm_span}")
        return s + (", value_mix=True" if self.value_mix is not None else "")
