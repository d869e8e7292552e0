"""A decoder-only transformer whose forward and backward run only tritonllm's Triton kernels.

    x = embedding(idx)
    for each block:  x = x + attention(rms_norm(x));  x = x + mlp(rms_norm(x))
    logits = rms_norm(x) @ W_head.T            (W_head = the embedding when tied)

Attention: one packed QKV GEMM, viewed as ``[B, T, Hq + 2 Hkv, D]`` and split into strided q, k,
v views (no copies); optional QK-norm (RMSNorm over D); RoPE on q and k; flash attention (GQA/MQA,
causal, optional sliding window); output GEMM. MLP: SwiGLU with gate and up packed in one GEMM
(``linear_swiglu``), then the down GEMM; or an MoE layer (:func:`build_mlp`).

Residual adds are fused into the RMSNorm kernels: ``rms_norm(delta, w, residual=x)`` returns
``(norm(x + delta) * w, x + delta)``. Each residual-stream tensor is then consumed exactly once,
so the backward pass has no autograd-side gradient accumulation (which would be a PyTorch add
kernel); adding in the output GEMM's epilogue (``linear(..., residual=x)``) instead would fork
the stream into the next norm and its residual, and cost that extra add. So a block receives the
stream and the previous block's MLP output not yet added; the first block adds the embedding to a
zero stream, the final norm adds the last MLP output.

Init (GPT-2): every weight matrix ``normal(0, init_std)``, the two output projections of each
block (attention ``proj`` and MLP ``w2``) ``normal(0, init_std / sqrt(2 * n_layers))`` so the
residual stream's variance does not grow with depth; RMSNorm weights ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tritonllm.kernels.flash_attention import flash_attention
from tritonllm.kernels.linear import linear
from tritonllm.kernels.linear_cross_entropy import linear_cross_entropy
from tritonllm.kernels.rope import rope, rope_cos_sin
from tritonllm.kernels.split_heads import split_heads
from tritonllm.models.config import ModelConfig
from tritonllm.nn import Embedding, Linear, LinearSwiGLU, RMSNorm


def _out_std(cfg: ModelConfig) -> float:
    """Init std of the projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


class KVCache:
    """Preallocated keys and values, ``[B, max_len, Hkv, D]`` per layer, and how many positions are filled.

    A forward with a cache attends to the cached positions plus its own; :meth:`Transformer.forward`
    advances ``pos`` once all layers have written.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None, dtype=None):
        shape = (batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.pos = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v [B, T, Hkv, D]`` at positions ``pos .. pos+T-1``; return views of all filled positions."""
        end = self.pos + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache of max_len {self.max_len} cannot hold {end} positions")
        self.k[layer][:, self.pos:end] = k
        self.v[layer][:, self.pos:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class Attention(nn.Module):
    """Causal self-attention with GQA/MQA, RoPE, optional QK-norm and optional sliding window."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.window
        self.qkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, init_std=cfg.init_std)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.proj = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, init_std=_out_std(cfg))

    def forward(self, x, cos, sin, cache: KVCache | None = None):
        B, T, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(B, T, Hq + 2 * Hkv, self.head_dim)
        pos = 0 if cache is None else cache.pos
        if self.q_norm is None:  # q and k are adjacent heads: one RoPE launch rotates both
            qk, v = split_heads(qkv, (Hq + Hkv, Hkv))
            q, k = split_heads(rope(qk, cos, sin, position_offset=pos), (Hq, Hkv))
        else:
            q, k, v = split_heads(qkv, (Hq, Hkv, Hkv))
            q = rope(self.q_norm(q), cos, sin, position_offset=pos)
            k = rope(self.k_norm(k), cos, sin, position_offset=pos)
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v)
        y = flash_attention(q, k, v, causal=True, window=self.window)
        return self.proj(y.reshape(B, T, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, window={self.window}"


class MLP(nn.Module):
    """Dense SwiGLU MLP: ``w2(silu(x W_gate^T) * (x W_up^T))``, gate and up in one packed GEMM."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = LinearSwiGLU(cfg.d_model, cfg.d_ff, init_std=cfg.init_std)
        self.w2 = Linear(cfg.d_ff, cfg.d_model, init_std=_out_std(cfg))

    def forward(self, x):
        return self.w2(self.w13(x))


def build_mlp(cfg: ModelConfig) -> nn.Module:
    """The MLP slot of a block: dense SwiGLU when ``cfg.n_experts == 0``, else ``tritonllm.nn.moe.MoE``.

    An MLP module maps ``[B, T, d_model] -> [B, T, d_model]`` (the block adds the residual) and may
    set, during forward, ``self.aux_loss`` (0-d fp32, already scaled by its coefficient,
    differentiable: added to the training loss) and ``self.stats`` (dict of detached floats to log).
    """
    if cfg.n_experts == 0:
        return MLP(cfg)
    from tritonllm.nn.moe import MoE

    return MoE(cfg)


class Block(nn.Module):
    """Pre-norm block. Takes the residual stream ``x`` and ``delta``, the previous block's MLP output
    not yet added, and returns ``(x + delta + attn, mlp(...))``: each add is fused into the norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = build_mlp(cfg)

    def forward(self, x, delta, cos, sin, cache: KVCache | None = None):
        h, x = self.attn_norm(delta, residual=x)
        h, x = self.mlp_norm(self.attn(h, cos, sin, cache), residual=x)
        return x, self.mlp(h)


class Transformer(nn.Module):
    """Decoder-only language model built from a :class:`ModelConfig`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # ids come from a tokenizer or a loader that rejects out-of-vocabulary batches: no per-step sync
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, validate=False)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, init_std=cfg.init_std)
        self.last_losses: dict[str, torch.Tensor] = {}
        self._rope = None

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head ``[vocab_size, d_model]``: the embedding matrix when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 RoPE ``cos, sin [max_seq_len, head_dim / 2]`` on ``device``, built once per device
        (kept out of the module's buffers so that ``.to(bfloat16)`` leaves them in fp32)."""
        device = torch.device(device)
        if self._rope is None or self._rope[0].device != device:
            cfg = self.cfg
            self._rope = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, theta=cfg.rope_theta,
                                      scaling=cfg.rope_scaling, device=device)
        return self._rope

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, d_model]`` of token ids ``idx [B, T]``."""
        T = idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"idx: sequence of {start + T} positions exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_tables(idx.device)
        delta = self.embed(idx)
        x = torch.zeros_like(delta)
        for block in self.blocks:
            x, delta = block(x, delta, cos, sin, cache)
        if cache is not None:
            cache.pos += T
        h, _ = self.norm(delta, residual=x)
        return h

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        """``idx [B, T]`` int64 -> logits ``[B, T, V]``, or with ``targets [B, T]`` the scalar training
        loss: mean cross-entropy (fused with the LM head, logits never stored) + z-loss + the MLPs'
        ``aux_loss``. Sets ``self.last_losses`` (detached 0-d tensors, no host synchronisation):
        ``ce``, ``z_loss``, ``aux`` (the MLPs' scaled auxiliary losses summed) and, for MoE models,
        ``moe_aux`` and ``moe_z`` (the unscaled router losses averaged over the layers) and
        ``moe_max_load`` (the busiest expert's load over a balanced one's, worst layer)."""
        h = self.hidden(idx, cache)
        if targets is None:
            return linear(h, self.head_weight)
        loss, z_loss = linear_cross_entropy(h.view(-1, h.shape[-1]), self.head_weight, targets.reshape(-1),
                                            z_loss=self.cfg.z_loss_coef, return_z_loss=True)
        # 0-d bookkeeping only (PyTorch scalar ops): the logged CE without its z-loss part, and
        # the MLPs' auxiliary losses summed into the training loss.
        ce = loss.detach() - z_loss if self.cfg.z_loss_coef else loss.detach()
        aux = torch.zeros((), device=loss.device)
        stats = []
        for m in self.modules():
            if getattr(m, "aux_loss", None) is not None:
                loss = loss + m.aux_loss
                aux = aux + m.aux_loss.detach()
            if getattr(m, "stats", None):
                stats.append(m.stats)
        self.last_losses = {"ce": ce, "z_loss": z_loss.detach(), "aux": aux}
        if stats:
            per_layer = {k: torch.stack([s[k].float() for s in stats]) for k in stats[0]}
            self.last_losses.update(moe_aux=per_layer["moe_aux"].mean(), moe_z=per_layer["moe_z"].mean(),
                                    moe_max_load=per_layer["moe_max_load"].max())
        return loss

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters held (a tied matrix once); ``exclude_embedding`` drops the token-embedding table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def num_active_params(self) -> int:
        """Parameters one token's forward multiplies with: all but the embedding lookup table (a tied
        matrix counts, as the LM head) and, in MoE layers, the experts it is not routed to."""
        cfg = self.cfg
        inactive = cfg.param_count() - cfg.param_count(active=True)
        return self.num_params(exclude_embedding=not cfg.tie_embeddings) - inactive

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6 N_active + 12 n_layers n_heads head_dim seq_len``."""
        cfg = self.cfg
        return 6 * self.num_active_params() + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx [B, T]``; returns ``[B, T + max_new_tokens]``.

        ``temperature`` 0 is greedy. With ``use_cache`` the prompt is run once into a :class:`KVCache`
        and each new token is one T=1 forward against it (the prompt plus new tokens must fit in
        ``max_seq_len``); without, every step re-runs the last ``max_seq_len`` tokens.
        """
        cache = None
        if use_cache:
            total = idx.shape[1] + max_new_tokens
            if total > self.cfg.max_seq_len:
                raise ValueError(f"max_new_tokens: prompt + new tokens = {total} exceeds max_seq_len "
                                 f"{self.cfg.max_seq_len}; use use_cache=False to slide the context")
            cache = KVCache(self.cfg, idx.shape[0], total, device=idx.device, dtype=self.head_weight.dtype)
        step_input = idx
        for _ in range(max_new_tokens):
            if cache is None:
                step_input = idx[:, -self.cfg.max_seq_len:]
            h = self.hidden(step_input, cache)
            logits = linear(h[:, -1], self.head_weight)
            step_input = sample_next(logits, temperature, top_k, top_p)
            idx = torch.cat([idx, step_input], dim=1)
        return idx


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]`` -> ``[B, 1]`` (sampling uses PyTorch ops).

    ``temperature`` 0 (or ``top_k`` 1) is argmax; ``top_k`` keeps the k largest logits; ``top_p``
    keeps the smallest set of tokens whose probability reaches p (nucleus sampling).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)


def build_model(cfg, device=None, dtype=None) -> Transformer:
    """A :class:`Transformer` from a :class:`ModelConfig`, a dict or a Hydra ``DictConfig``,
    moved to ``device`` / ``dtype`` when given."""
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.from_dict(cfg)
    return Transformer(cfg).to(device=device, dtype=dtype)
