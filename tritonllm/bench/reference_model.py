"""The tritonllm Transformer's architecture in plain PyTorch ops: the tests' reference.

Same parameter names and shapes as ``tritonllm.models.Transformer`` (``load_state_dict`` from it
works), computed in the dtype of its parameters with ``F.linear``, ``F.cross_entropy`` and the eager
RMSNorm / RoPE / SwiGLU / explicit softmax attention of :mod:`tritonllm.bench.reference_ops`.
No tritonllm kernel is used.
``ReferenceTransformer(cfg, sdpa=True)`` runs full causal attention through
``F.scaled_dot_product_attention``. Written for clarity, not speed (its RoPE tables are rebuilt
in every forward): the training benchmark's baseline is ``tritonllm.bench.baseline_model``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.bench.reference_ops import attention as reference_attention
from tritonllm.bench.reference_ops import relu2, rms_norm, rope, softcap, swiglu


def rope_tables(cfg, dtype, device=None):
    """cos, sin ``[max_seq_len, head_dim / 2]``: angle ``t * theta^(-2i / head_dim)`` (no scaling)."""
    assert cfg.rope_scaling is None, "the reference implements unscaled RoPE only"
    inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=device) / cfg.head_dim)
    angles = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def attention(q, k, v, window, sdpa=False):
    """Causal attention (:func:`tritonllm.bench.reference_ops.attention`); ``sdpa`` (no window):
    through ``F.scaled_dot_product_attention``."""
    if sdpa and window is None:
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=q.shape[2] != k.shape[2])
        return y.transpose(1, 2)
    return reference_attention(q, k, v, window=window)


class _Linear(nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k))


class _Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))


class Attention(nn.Module):
    def __init__(self, cfg, sdpa=False, layer=0):
        super().__init__()
        self.cfg, self.sdpa, self.window = cfg, sdpa, cfg.layer_window(layer)
        self.qkv = _Linear((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.d_model)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _Norm(cfg.head_dim), _Norm(cfg.head_dim)
        self.proj = _Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        if cfg.layer_value_embedding(layer) is not None:
            self.value_mix = nn.Parameter(torch.empty(2))

    def forward(self, x, cos, sin, ve=None):
        cfg = self.cfg
        B, T, _ = x.shape
        qkv = F.linear(x, self.qkv.weight).view(B, T, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)
        q, k, v = qkv.split([cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads], dim=2)
        if ve is not None:  # value embedding: v = a v + b ve
            v = self.value_mix[0] * v + self.value_mix[1] * ve.view(v.shape)
        if cfg.qk_norm:
            q, k = rms_norm(q, self.q_norm.weight, cfg.norm_eps), rms_norm(k, self.k_norm.weight, cfg.norm_eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = attention(q, k, v, self.window, self.sdpa)
        return F.linear(y.reshape(B, T, -1), self.proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w13 = _Linear(2 * cfg.d_ff, cfg.d_model)
        self.w2 = _Linear(cfg.d_model, cfg.d_ff)

    def forward(self, x):
        return F.linear(swiglu(F.linear(x, self.w13.weight)), self.w2.weight)


class ReLU2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = _Linear(cfg.d_ff, cfg.d_model)
        self.w2 = _Linear(cfg.d_model, cfg.d_ff)

    def forward(self, x):
        return F.linear(relu2(F.linear(x, self.w1.weight)), self.w2.weight)


class Block(nn.Module):
    def __init__(self, cfg, sdpa=False, layer=0):
        super().__init__()
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = _Norm(cfg.d_model), _Norm(cfg.d_model)
        self.attn = Attention(cfg, sdpa, layer)
        self.mlp = ReLU2MLP(cfg) if cfg.mlp_act == "relu2" else MLP(cfg)

    def forward(self, x, cos, sin, ve=None):
        x = x + self.attn(rms_norm(x, self.attn_norm.weight, self.cfg.norm_eps), cos, sin, ve)
        return x + self.mlp(rms_norm(x, self.mlp_norm.weight, self.cfg.norm_eps))


class ReferenceTransformer(nn.Module):
    """Plain-PyTorch twin of ``tritonllm.models.Transformer`` (dense MLP only)."""

    def __init__(self, cfg, sdpa=False):
        super().__init__()
        assert cfg.n_experts == 0, "the reference has the dense MLP only"
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, sdpa, i) for i in range(cfg.n_layers))
        self.norm = _Norm(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else _Linear(cfg.vocab_size, cfg.d_model)
        kv = cfg.n_kv_heads * cfg.head_dim
        if cfg.value_embeddings:
            self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, kv) for _ in range(cfg.value_embeddings))
        if cfg.unet_skips:
            self.skip_gates = nn.ParameterList(nn.Parameter(torch.empty(1)) for _ in range(cfg.n_layers // 2))

    def forward(self, idx, targets=None):
        """Logits ``[B, T, V]`` (soft-capped, c tanh(logits / c), with ``logit_softcap`` c), or the loss: mean cross-entropy + z_loss_coef * mean(logsumexp^2), both
        over the targets that are not -100."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg, self.norm.weight.dtype, idx.device)
        x = self.embed(idx)
        n, skips = cfg.n_layers, []
        for i, block in enumerate(self.blocks):
            t = cfg.layer_value_embedding(i)
            if cfg.unet_skips and i >= n - n // 2:  # U-net: block j's output, gated, into block n - 1 - j
                x = x + self.skip_gates[n - 1 - i] * skips.pop()
            x = block(x, cos, sin, None if t is None else self.value_embeds[t](idx))
            if cfg.unet_skips and i < n // 2:
                skips.append(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(rms_norm(x, self.norm.weight, cfg.norm_eps), head)
        if cfg.logit_softcap is not None:
            logits = softcap(logits, cfg.logit_softcap)
        if targets is None:
            return logits
        logits, targets = logits.view(-1, logits.shape[-1]), targets.reshape(-1)
        loss = F.cross_entropy(logits, targets)
        if cfg.z_loss_coef:  # skipped at 0: the masked logsumexp would cost the benchmark baseline a sync
            loss = loss + cfg.z_loss_coef * torch.logsumexp(logits[targets != -100], dim=-1).pow(2).mean()
        return loss
